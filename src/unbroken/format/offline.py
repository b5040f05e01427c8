"""Whole-checkpoint work done by one process: consolidating weights (`unbroken.format.audit`
verifies every byte).

These read checkpoints written by any number of ranks; they never need the job itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from unbroken.errors import CheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import Chunk, Manifest, TensorEntry, step_dir
from unbroken.format.shards import fill, read_many

# Wrappers whose prefixes an inference model does not have: DDP, torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def consolidate(
    directory: Directory,
    manifest: Manifest,
    only: list[str],
    dtype: torch.dtype | None,
    progress: Callable[[int], None] = lambda n: None,
    strip: Sequence[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors of the state entries ``only``, named by `export_names`, floating
    ones cast to ``dtype``. ``progress`` gets the number of stored bytes read after each
    tensor (`selected_bytes` is their total)."""
    for key, name in export_names(manifest, only, strip).items():
        whole = read_whole(directory, manifest, key)
        progress(sum(c.nbytes for c in _rank0_chunks(manifest.tensors[key])))
        yield name, cast(whole, dtype)


def export_names(manifest: Manifest, only: list[str], strip: Sequence[str] = ()) -> dict[str, str]:
    """The tensors of the state entries ``only``, each mapped to its name as an unwrapped
    module names it (``model/module.fc.weight`` becomes ``fc.weight``; with several
    entries, ``model/fc.weight``), less the first of the prefixes ``strip`` it starts with
    (``model.`` for a Lightning module holding the model as ``self.model``)."""
    prefixes = [f"{name}/" for name in only]
    found = {p for key in manifest.tensors for p in prefixes if key.startswith(p)}
    if missing := [p[:-1] for p in prefixes if p not in found]:
        names = sorted({key.split("/", 1)[0] for key in manifest.tensors})
        raise CheckpointError(
            f"step {manifest.step} has no tensors under {missing}; entries with tensors: "
            f"{names}. Pass --only NAME"
        )
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for key in manifest.tensors:
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            continue
        name = key[len(prefix) :]
        for wrapper in _WRAPPER_PREFIXES:
            name = name.removeprefix(wrapper)
        if len(prefixes) > 1:
            name = f"{prefix}{name}"
        name = next((name[len(s) :] for s in strip if name.startswith(s)), name)
        if name in seen:
            raise CheckpointError(
                f"tensors {seen[name]!r} and {key!r} would both be exported as {name!r}; "
                "export fewer entries (--only) or strip fewer prefixes"
            )
        out[key], seen[name] = name, key
    return out


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` if it is floating point and a ``dtype`` is given."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def read_whole(directory: Directory, manifest: Manifest, key: str) -> torch.Tensor:
    """Tensor ``key`` of ``manifest``'s step, whole, on the CPU, every byte checked against
    its checksum. Where ranks saved different values under one key, rank 0's."""
    entry = manifest.tensors[key]
    whole = torch.empty(entry.shape, dtype=entry.torch_dtype)
    folder = step_dir(manifest.step)
    fill(directory.storage, folder, key, entry, _rank0_chunks(entry), whole, [0] * len(entry.shape))
    return whole


def read_all(
    directory: Directory, manifest: Manifest, keys: Sequence[str], threads: int
) -> dict[str, torch.Tensor]:
    """`read_whole` for each of ``keys``, read by ``threads`` in parallel, with runs of
    small tensors fetched in one request (object stores charge a round trip for each)."""
    folder = step_dir(manifest.step)
    out: dict[str, torch.Tensor] = {}
    whole: list[tuple[str, TensorEntry, Chunk, torch.Tensor]] = []
    for key in keys:
        entry = manifest.tensors[key]
        chunks = _rank0_chunks(entry)
        if len(chunks) == 1 and chunks[0].shape == entry.shape:
            out[key] = torch.empty(entry.shape, dtype=entry.torch_dtype)
            whole.append((key, entry, chunks[0], out[key]))
        else:
            out[key] = read_whole(directory, manifest, key)
    read_many(directory.storage, folder, whole, threads)
    return out


def _rank0_chunks(entry: TensorEntry) -> list[Chunk]:
    return [c for c in entry.chunks if c.ranks is None or 0 in c.ranks]


def selected_bytes(manifest: Manifest, only: list[str]) -> int:
    """The stored bytes `consolidate` reads for the state entries ``only``."""
    prefixes = tuple(f"{name}/" for name in only)
    return sum(
        c.nbytes
        for key, entry in manifest.tensors.items()
        if key.startswith(prefixes)
        for c in entry.chunks
        if c.ranks is None or 0 in c.ranks
    )
