"""How a DCP checkpoint sits in unbroken's format: one step directory, shard files in
safetensors layout, and a manifest that carries DCP's metadata as JSON.

The manifest is an ordinary unbroken manifest (so ``unbroken ls/show/verify/export``
read it) with one extra top-level field, ``"dcp"``:

- ``metadata``: DCP's `Metadata` as JSON (see `unbroken.dcp._metadata`), never pickle;
- ``keys``: for each DCP fully-qualified name, the manifest key its chunks are under.

Tensor chunks are stored as tensors. Bytes items (the non-tensor values DCP's planner
serialises with ``torch.save``) are stored as opaque 1-D ``U8`` tensors under their own
key, so their bytes are checksummed and verified like any tensor's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import (
    MANIFEST,
    Chunk,
    Manifest,
    TensorEntry,
    block_checksums,
    step_dir,
)
from unbroken.storage import open_storage

log = logging.getLogger("unbroken")

FIELD = "dcp"
LAYOUT_VERSION = 1  # of the "dcp" field; bumped on any change an older reader could misread


def stored_chunk(
    offsets: list[int], shape: list[int], file: str, start: int, end: int, data: memoryview
) -> Chunk:
    """The manifest entry for one block written to ``file`` at ``[start, end)`` whose bytes
    are ``data``: every chunk the DCP writer and the converter store is built here."""
    return Chunk(
        offsets=list(offsets), shape=list(shape), file=file, start=start, end=end,
        **block_checksums(data).fields(),
    )  # fmt: skip


def block_name(fqn: str, offset: Sequence[int] | None) -> str:
    """A block's name in its safetensors file: unique among one rank's blocks."""
    if offset is None or not any(offset):
        return fqn
    return f"{fqn}@{','.join(map(str, offset))}"


def bytes_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a 1-D uint8 tensor that owns a copy of it."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class Stored:
    """Where one DCP item went: what a rank reports to the coordinator after writing."""

    fqn: str
    dtype: str  # unbroken dtype name; "U8" for bytes items
    chunk: Chunk
    file_size: int


@dataclass(frozen=True)
class DcpCheckpoint:
    """A committed step written through `unbroken.dcp`: its manifest and DCP field."""

    directory: Directory
    manifest: Manifest
    metadata: dict[str, Any]  # DCP metadata as JSON
    keys: dict[str, str]  # fqn -> manifest key

    @property
    def folder(self) -> str:
        return step_dir(self.manifest.step)


def manifest_keys(fqns: list[str], paths: dict[str, list[str | int]] | None) -> dict[str, str]:
    """The manifest key of each fqn: its path in the nested state dict joined by ``/``
    (``model.0.weight`` from ``{"model": {"0.weight": ...}}`` is ``model/0.weight``, as
    unbroken names it, so ``unbroken export --only model`` finds it); the fqn itself
    where the planner recorded no path, or where two paths would give one key."""
    keys = {fqn: "/".join(map(str, paths[fqn])) if paths and fqn in paths else fqn for fqn in fqns}
    if len(set(keys.values())) != len(keys):
        return {fqn: fqn for fqn in fqns}
    return keys


def commit(
    directory: Directory, step: int, world_size: int, stored: list[Stored],
    metadata: dict[str, Any], paths: dict[str, list[str | int]] | None,
) -> None:  # fmt: skip
    """Write the manifest of ``step`` atomically (the step exists from now on) and move
    ``latest`` to it unless a newer step is committed. Refuses to replace a step another
    writer committed meanwhile."""
    keys = manifest_keys(sorted({s.fqn for s in stored}), paths)
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, int] = {}
    sizes = metadata["state_dict"]
    for s in sorted(stored, key=lambda s: (s.fqn, s.chunk.offsets)):
        files[s.chunk.file] = s.file_size
        entry = tensors.get(keys[s.fqn])
        if entry is None:
            shape = sizes[s.fqn].get("size", s.chunk.shape)
            entry = tensors[keys[s.fqn]] = TensorEntry(dtype=s.dtype, shape=list(shape))
        entry.chunks.append(s.chunk)
    manifest = Manifest(
        step=step, world_size=world_size, created=time.time(), tensors=tensors,
        objects=[{}], rank_objects=[0] * world_size, files=files,
    )  # fmt: skip
    body = json.loads(manifest.to_json())
    body[FIELD] = {"version": LAYOUT_VERSION, "metadata": metadata, "keys": keys}
    try:
        directory.storage.commit(
            f"{step_dir(step)}/{MANIFEST}", json.dumps(body, separators=(",", ":")).encode()
        )
    except FileExistsError:
        raise CheckpointError(
            f"{directory.path}: step {step} was committed by another writer meanwhile"
        ) from None
    try:  # never back: a converted old step must not hide newer ones from restore
        newest = directory.latest()
        if newest is None or newest <= step:
            directory.move_latest(step)
    except Exception as e:  # the step is committed; readers find it by listing
        log.warning("step %d is committed but the latest pointer did not move: %s", step, e)


def refuse_committed(directory: Directory, step: int) -> None:
    """Before writing ``step``: refuse to replace it, and remove what crashed saves left
    (nobody can be writing them: only the coordinator calls this, before any rank writes)."""
    if directory.is_committed(step):
        raise CheckpointError(
            f"{directory.path}: step {step} is already committed; save under a new step "
            f"(unbroken.dcp.Writer(path, step=...)), or delete {step_dir(step)} first"
        )
    directory.clear_leftovers()


def latest(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> int | None:
    """The newest committed step under ``path`` (None if there is none): the step to
    resume from, found through the ``latest`` pointer without listing where it can."""
    text = os.fspath(path)
    return Directory(open_storage(text, storage_options), text).latest()


def _dcp(directory: Directory) -> str:
    """What to do where ``directory`` is a checkpoint of DCP's own writer (its
    ``.metadata``, a pickle), else nothing."""
    if ".metadata" not in directory.storage.list(""):
        return ""
    return (
        ": it is a checkpoint of DCP's own FileSystemWriter (it has .metadata). Read it "
        "with torch.distributed.checkpoint.FileSystemReader, or convert it once, if you "
        f"trust where it came from (.metadata is a pickle): `unbroken convert {directory.path} "
        "DST --to unbroken --trust-pickle`, then read DST with unbroken.dcp.Reader"
    )


def read_manifest(directory: Directory, step: int | None) -> tuple[Manifest, dict[str, Any]]:
    """The manifest of ``step`` (default: the newest committed), parsed and as raw JSON
    (which holds the ``"dcp"`` field when there is one); one read."""
    if step is None:
        step = directory.latest()
        if step is None:
            raise CheckpointError(
                f"{directory.path} holds no committed checkpoint{_dcp(directory)}"
            )
    name = f"{step_dir(step)}/{MANIFEST}"
    where = f"{directory.path}/{name}"
    try:
        data = directory.storage.read(name)
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory.path} has no committed checkpoint for step {step}; committed "
            f"steps: {directory.steps()}"
        ) from None
    manifest = Manifest.from_json(data, where)
    if manifest.step != step:
        raise CheckpointError(f"{where} says it is step {manifest.step}, not {step}")
    return manifest, json.loads(data)


def open_checkpoint(directory: Directory, step: int | None) -> DcpCheckpoint:
    """The DCP view of ``step`` (default: the newest committed one)."""
    manifest, raw = read_manifest(directory, step)
    return dcp_view(directory, manifest, raw)


def dcp_view(directory: Directory, manifest: Manifest, raw: dict[str, Any]) -> DcpCheckpoint:
    """The DCP view of a manifest read by `read_manifest`."""
    where = f"{directory.path}/{step_dir(manifest.step)}/{MANIFEST}"
    field = raw.get(FIELD)
    if field is None:
        raise CheckpointError(
            f"{where} was not written through unbroken.dcp (it has no DCP metadata): "
            "restore it with unbroken.Checkpointer, which wrote it, or make a DCP "
            "checkpoint of it with `unbroken convert SRC DST --to dcp`"
        )
    if not isinstance(field, dict) or not isinstance(field.get("version"), int):
        raise CorruptCheckpointError(f"{where}: its {FIELD!r} field is malformed")
    if field["version"] > LAYOUT_VERSION:
        raise CheckpointError(
            f"{where} holds DCP metadata of layout version {field['version']}, newer than "
            f"this unbroken reads ({LAYOUT_VERSION}); upgrade unbroken"
        )
    try:
        metadata, keys = field["metadata"], field["keys"]
    except KeyError as e:
        raise CorruptCheckpointError(f"{where}: its {FIELD!r} field lacks {e}") from None
    if missing := sorted(set(keys.values()) - set(manifest.tensors)):
        raise CorruptCheckpointError(f"{where}: DCP items {missing[:5]} have no stored chunks")
    return DcpCheckpoint(directory, manifest, metadata, keys)


@dataclass(frozen=True)
class Where:
    """The manifest key, entry and chunk of one DCP item."""

    key: str
    entry: TensorEntry
    chunk: Chunk


def locate(ckpt: DcpCheckpoint, metadata: Metadata, where: str) -> dict[MetadataIndex, Where]:
    """Each DCP item's stored chunk; a chunk DCP's metadata names but the manifest lacks
    (or holds with another shape) is damage."""
    found: dict[MetadataIndex, Where] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        key = ckpt.keys.get(fqn)
        entry = ckpt.manifest.tensors.get(key) if key is not None else None
        if key is None or entry is None:
            raise CorruptCheckpointError(f"{where}: DCP item {fqn!r} has no stored chunks")
        by_offsets = {tuple(c.offsets): c for c in entry.chunks}
        if not hasattr(md, "chunks"):  # bytes: one chunk
            found[MetadataIndex(fqn)] = Where(key, entry, entry.chunks[0])
            continue
        for c in md.chunks:
            chunk = by_offsets.get(tuple(c.offsets))
            if chunk is None or chunk.shape != list(c.sizes):
                raise CorruptCheckpointError(
                    f"{where}: tensor {fqn!r} has no stored chunk at {list(c.offsets)} of "
                    f"shape {list(c.sizes)}"
                )
            found[MetadataIndex(fqn, c.offsets)] = Where(key, entry, chunk)
    return found
