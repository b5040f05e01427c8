"""The `unbroken` command: ls, show, verify, export, demo."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from functools import partial

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from unbroken.directory import Directory
from unbroken.errors import CheckpointError
from unbroken.offline import consolidate, verify
from unbroken.state import leaves
from unbroken.storage import open_storage

# Wide enough for long tensor names when the output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 160)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["demo"]:
        from unbroken.demo.run import main as demo

        return demo(args[1:])
    if args[:1] == ["run"]:  # before argparse: torchrun's options pass through untouched
        from unbroken.run.cli import main as run

        return run(args[1:])
    parser = _parser()
    opts = parser.parse_args(args)
    try:
        return int(opts.func(opts))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unbroken", description="Inspect, verify and export unbroken checkpoints."
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    ls = sub.add_parser("ls", help="list committed checkpoints")
    ls.add_argument("path")
    ls.set_defaults(func=_ls)
    show = sub.add_parser("show", help="tensors and non-tensor state of one checkpoint")
    show.add_argument("path")
    show.add_argument("--step", type=int, help="default: the newest")
    show.set_defaults(func=_show)
    ver = sub.add_parser("verify", help="re-read every byte and check every checksum")
    ver.add_argument("path")
    which = ver.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="default: the newest")
    which.add_argument("--all", action="store_true", help="every committed step")
    ver.set_defaults(func=_verify)
    exp = sub.add_parser("export", help="consolidated safetensors weights for inference")
    exp.add_argument("path")
    exp.add_argument("out", help="the .safetensors file to write")
    exp.add_argument("--step", type=int, help="default: the newest")
    exp.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    exp.add_argument(
        "--only", action="append", help="state entry to export (repeatable; default: model)"
    )
    exp.set_defaults(func=_export)
    sub.add_parser("demo", help="train, kill and resume a small GPT under torchrun")
    sub.add_parser("run", help="torchrun with restarts, hang detection and fault injection")
    return parser


def _open(path: str) -> Directory:
    if not os.path.exists(path) and "://" not in path:
        raise CheckpointError(f"{path} does not exist")
    return Directory(open_storage(path), path)


def _ls(opts: argparse.Namespace) -> int:
    directory = _open(opts.path)
    steps = directory.steps()
    if not steps:
        console.print(f"{opts.path}: no committed checkpoints")
        return 0
    table = Table("step", "size", "tensors", "ranks", "saved", title=opts.path)
    for step in steps:
        m = directory.manifest(step)
        table.add_row(
            str(step), _size(m.nbytes), str(len(m.tensors)), str(m.world_size), _time(m.created)
        )
    console.print(table)
    return 0


def _show(opts: argparse.Namespace) -> int:
    m = _open(opts.path).manifest(opts.step)
    console.print(
        f"step {m.step}: {_size(m.nbytes)} in {len(m.files)} files, saved by {m.world_size} "
        f"ranks at {_time(m.created)} (format version {m.version})",
        highlight=False,
    )
    table = Table("tensor", "dtype", "shape", "blocks", "size")
    for key, entry in m.tensors.items():
        table.add_row(
            key,
            entry.dtype,
            str(tuple(entry.shape)),
            str(len(entry.chunks)),
            _size(sum(c.nbytes for c in entry.chunks)),
        )
    console.print(table)
    values = Table("key", "value", title="non-tensor state (rank 0)")
    for path, value in leaves(m.objects_for(0)):
        text = repr(value)
        values.add_row(path, text if len(text) <= 60 else text[:57] + "...")
    console.print(values)
    if len(m.objects) > 1:
        console.print(f"{len(m.objects)} distinct per-rank versions of the non-tensor state")
    return 0


def _verify(opts: argparse.Namespace) -> int:
    directory = _open(opts.path)
    steps = directory.steps() if opts.all else [directory.manifest(opts.step).step]
    damaged = 0
    for step in steps:
        m = directory.manifest(step)
        with _bar() as bar:
            total = sum(c.nbytes for e in m.tensors.values() for c in e.chunks)
            task = bar.add_task(f"step {step}", total=total)
            damage = verify(directory, m, partial(bar.advance, task))
        for d in damage:
            where = f"{d.file}" + (f", tensor {d.tensor!r}" if d.tensor else "")
            console.print(f"[red]DAMAGED[/red] step {step}: {where}: {d.problem}", highlight=False)
        if damage:
            damaged += 1
        else:
            console.print(f"[green]OK[/green] step {step}: every checksum matches", highlight=False)
    return 1 if damaged else 0


def _export(opts: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    directory = _open(opts.path)
    m = directory.manifest(opts.step)
    dtype = getattr(torch, opts.dtype) if opts.dtype else None
    only = opts.only or ["model"]
    tensors: dict[str, torch.Tensor] = {}
    with _bar() as bar:
        task = bar.add_task(f"step {m.step}", total=None)
        for name, tensor in consolidate(directory, m, only, dtype):
            tensors[name] = tensor
            bar.advance(task, tensor.nbytes)
    save_file(tensors, opts.out, metadata={"unbroken_step": str(m.step)})
    size = sum(t.nbytes for t in tensors.values())
    console.print(f"wrote {len(tensors)} tensors, {_size(size)}, to {opts.out}", highlight=False)
    return 0


def _bar() -> Progress:
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _time(created: float) -> str:
    return datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")
