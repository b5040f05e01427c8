"""The checkpoint commands that write: export (safetensors, or a Hugging Face folder
through `unbroken.cli.hf_export`) and convert (DCP, through `unbroken.dcp.convert`).
Both need torch; `unbroken.cli.main` imports this module only for them."""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

from unbroken.access import Access
from unbroken.cli import hf_export
from unbroken.cli.commands import bar, console, open_directory, size
from unbroken.errors import CheckpointError
from unbroken.format.offline import consolidate, selected_bytes

OK = 0
NO_CONFIG = (
    "note: no --config: the folder holds the weights and their index but no config.json, "
    "so from_pretrained cannot load it by itself, and tied weights (an embedding shared "
    "with the output layer) are written twice. Pass --config path/to/config.json, or copy "
    "config.json into {out} yourself"
)


def export(opts: argparse.Namespace) -> int:
    if os.path.exists(opts.out) and not opts.force:
        raise CheckpointError(f"{opts.out} already exists; pass --force to overwrite it")
    if opts.format != "hf" and opts.config:
        raise CheckpointError("--config needs --format hf")
    if opts.config and not os.path.isfile(opts.config):
        raise CheckpointError(f"--config {opts.config}: no such file (a config.json)")
    if opts.format != "hf":  # the hf folder is made with its parents
        hf_export.check_destination(opts.out)
    directory = open_directory(opts)
    m = directory.manifest(opts.step)
    dtype = getattr(torch, opts.dtype) if opts.dtype else None
    only = opts.only or ["model"]
    with bar(opts) as progress:
        task = progress.add_task(f"reading step {m.step}", total=selected_bytes(m, only))
        advance = partial(progress.advance, task)
        if opts.format == "hf":
            done = hf_export.export(
                directory, m, opts.out, only=only, dtype=dtype, strip=opts.strip_prefix,
                max_shard_size=hf_export.parse_size(opts.max_shard_size), config=opts.config,
                progress=advance,
            )  # fmt: skip
            tied = "".join(f", {a} tied to {b}" for a, b in done.tied.items())
            console.print(
                f"wrote {done.tensors} tensors, {size(done.nbytes)}, in {len(done.files) - 1} "
                f"shard(s) to {opts.out}{tied}",
                highlight=False,
            )
            if not opts.config:
                print(NO_CONFIG.format(out=opts.out), file=sys.stderr)
            return OK
        tensors = dict(consolidate(directory, m, only, dtype, advance, opts.strip_prefix))
    partial_out = f"{opts.out}.partial"  # a reader never sees half a file under OUT
    meta = {**hf_export.METADATA, "unbroken_step": str(m.step)}
    hf_export.save_file(tensors, partial_out, meta, Access.from_env())
    os.replace(partial_out, opts.out)
    total = sum(t.nbytes for t in tensors.values())
    console.print(f"wrote {len(tensors)} tensors, {size(total)}, to {opts.out}", highlight=False)
    return OK


def convert(opts: argparse.Namespace) -> int:
    from unbroken.dcp.convert import command

    local = "://" not in opts.path
    if opts.to == "unbroken" and local:  # before any warning about unpickling it
        if not os.path.isdir(opts.path):
            raise CheckpointError(f"{opts.path} does not exist, or is not a folder")
        if not os.path.isfile(os.path.join(opts.path, ".metadata")):
            raise CheckpointError(
                f"{opts.path} is not a DCP checkpoint: it has no .metadata file (an unbroken "
                "checkpoint needs no converting; convert --to dcp goes the other way)"
            )
    return command(opts)
