"""`unbroken convert`: DCP's FileSystemWriter layout <-> unbroken's format, byte for byte.

DCP -> unbroken reads DCP's ``.metadata``, which is a Python pickle: unpickling runs any
code it holds, so it happens only when the caller says it trusts the source
(``trust_pickle=True``, ``--trust-pickle``), with a warning. Tensors are read with
``torch.load(weights_only=True)``; bytes items are copied as they are, never unpickled.
The result is the layout `unbroken.dcp.Writer` writes: JSON metadata, checksummed blocks.

unbroken -> DCP reads a step that `unbroken.dcp.Writer` (or this converter) committed,
verifying every block, and writes DCP's own layout: ``__R_N.distcp`` files holding
``torch.save``d tensors and the bytes items as stored, then ``.metadata`` (pickled, as
DCP's reader expects) atomically, last. A step `unbroken.Checkpointer` wrote has no DCP
metadata; its state is rebuilt and saved with DCP's own writer (`native_to_dcp`).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from unbroken.access import Access
from unbroken.dcp._layout import (
    FIELD,
    Stored,
    Where,
    block_name,
    bytes_tensor,
    commit,
    dcp_view,
    locate,
    read_manifest,
    refuse_committed,
    stored_chunk,
)
from unbroken.dcp._metadata import from_json, to_json
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import MANIFEST, Manifest, dtype_name, step_dir
from unbroken.format.shards import byte_view, fill, read_chunk, write_blocks
from unbroken.storage import Storage, open_storage
from unbroken.tree import decode, tensor_keys

DCP_METADATA = ".metadata"
_DCP_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_SHARD_FILE = re.compile(r"^r(\d+)-(\d+)\.safetensors$")


def pickle_refusal(src: str) -> str:
    return (
        f"{src}/{DCP_METADATA} is a Python pickle (DCP's own format): reading it runs any "
        "code it holds, so unbroken does not read it unless told to. If you trust where "
        "this checkpoint came from, convert it with --trust-pickle (trust_pickle=True); "
        "the converted checkpoint keeps its metadata as JSON and never needs pickle again."
    )


class UnpicklingWarning(UserWarning):
    """A DCP ``.metadata`` is being unpickled, as the caller asked."""


def unpickling_warning(src: str) -> str:
    return (
        f"unpickling {src}/{DCP_METADATA} as asked (--trust-pickle): this runs any code "
        "the file holds; do it only for checkpoints from a source you trust"
    )


def dcp_to_unbroken(
    src: str, dst: str, *, step: int, trust_pickle: bool = False,
    storage_options: dict[str, Any] | None = None, io_threads: int = 4,
) -> int:  # fmt: skip
    """Convert the DCP checkpoint ``src`` into step ``step`` of the unbroken checkpoint
    directory ``dst``; returns the number of items converted. Each DCP rank's items go to
    that rank's shard files; one rank's items are in memory at a time."""
    source = open_storage(src)
    try:
        source.size(DCP_METADATA)
    except FileNotFoundError:
        raise CheckpointError(
            f"{src} has no {DCP_METADATA}: it is not a DCP checkpoint in FileSystemWriter "
            "layout (convert --to dcp goes the other way)"
        ) from None
    if not trust_pickle:
        raise CheckpointError(pickle_refusal(src))
    warnings.warn(unpickling_warning(src), UnpicklingWarning, stacklevel=2)
    metadata = pickle.loads(source.read(DCP_METADATA))
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{src}/{DCP_METADATA} does not hold DCP Metadata")
    directory = Directory(open_storage(dst, storage_options), dst)
    refuse_committed(directory, step)
    by_rank: dict[int, list[tuple[MetadataIndex, _StorageInfo]]] = defaultdict(list)
    for index, info in metadata.storage_data.items():
        match = _DCP_FILE.match(info.relative_path)
        by_rank[int(match.group(1)) if match else 0].append((index, info))
    stored: list[Stored] = []
    for rank, items in sorted(by_rank.items()):
        blocks = [
            (block_name(index.fqn, index.offset), _dcp_item(source, src, metadata, index, info))
            for index, info in items
        ]
        where, sizes = write_blocks(directory.storage, step_dir(step), rank, blocks, io_threads)
        for (index, _), (name, tensor) in zip(items, blocks, strict=True):
            file, start, end = where[name]
            offsets = list(index.offset) if index.offset is not None else [0]
            chunk = stored_chunk(offsets, list(tensor.shape), file, start, end, byte_view(tensor))
            stored.append(Stored(index.fqn, dtype_name(tensor.dtype), chunk, sizes[file]))
    meta = to_json(metadata)
    commit(directory, step, max(by_rank, default=0) + 1, stored, meta, meta["planner_data"])
    return len(stored)


def _dcp_item(
    source: Storage, src: str, metadata: Metadata, index: MetadataIndex, info: _StorageInfo
) -> torch.Tensor:
    """One stored DCP item: a tensor (its chunk), or a bytes item as raw uint8."""
    what = f"{src}/{info.relative_path}: item {index.fqn!r}"
    if info.transform_descriptors:
        raise CheckpointError(
            f"{what} is stored through DCP extensions {list(info.transform_descriptors)}, "
            "which convert does not undo; save it again without them"
        )
    raw = bytearray(info.length)
    try:
        source.read_into(info.relative_path, info.offset, memoryview(raw))
    except (FileNotFoundError, EOFError) as e:
        raise CorruptCheckpointError(f"{what} cannot be read ({e})") from None
    if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
        return bytes_tensor(bytes(raw))
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{what} is not a torch.save'd tensor ({e}); only DCP's default torch_save "
            "serialization is converted"
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{what} holds a {type(tensor).__name__}, not a tensor")
    return tensor.contiguous()


def unbroken_to_dcp(
    src: str, dst: str, *, step: int | None = None, force: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> int:  # fmt: skip
    """Convert step ``step`` (default: the newest) of ``src`` into a DCP checkpoint in
    FileSystemWriter layout in the local folder ``dst``; returns the number of items
    converted. Every block is verified on the way.

    A step written through `unbroken.dcp` is converted item for item. One that
    `unbroken.Checkpointer` wrote is joined into whole tensors in memory, with its
    non-tensor state, and saved with DCP's own writer: `native_to_dcp`. What is written
    gets `Access.from_env` modes (files 0600, a new ``dst`` 0700), whatever the umask."""
    if "://" in dst:
        raise CheckpointError(f"{dst}: DCP's FileSystemWriter layout is written to a local path")
    target = os.path.join(dst, DCP_METADATA)
    if os.path.exists(target) and not force:
        raise CheckpointError(f"{dst} already holds a DCP checkpoint; pass --force to replace it")
    directory = Directory(open_storage(src, storage_options), src)
    manifest, raw = read_manifest(directory, step)
    if FIELD not in raw:
        return native_to_dcp(directory, manifest, dst)
    ckpt = dcp_view(directory, manifest, raw)
    where = f"{src}/{ckpt.folder}/{MANIFEST}"
    metadata = from_json(ckpt.metadata, where)
    located = locate(ckpt, metadata, where)
    by_file: dict[str, list[tuple[MetadataIndex, Where]]] = defaultdict(list)
    for index, item in located.items():
        by_file[item.chunk.file].append((index, item))
    access = Access.from_env()
    access.makedirs(dst)
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    for file, items in sorted(by_file.items()):
        name = _dcp_file(file)
        items.sort(key=lambda pair: pair[1].chunk.start)
        storage_data.update(_write_dcp_file(ckpt.directory, ckpt.folder, dst, name, items, access))
    metadata.storage_data = storage_data
    _publish(target, pickle.dumps(metadata), access)
    return len(storage_data)


def native_to_dcp(directory: Directory, manifest: Manifest, dst: str) -> int:
    """Save a `Checkpointer` step with DCP's FileSystemWriter: the state as rank 0 saved
    it (tensors whole, non-tensor values as DCP's bytes items), so DCP's planner loads it
    into the same nested state dicts, on any number of ranks. Holds it all in memory.
    Values that differ between ranks cannot be kept (DCP keeps one per key): rank 0's
    are, with a warning naming what was left out."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    folder, tree = step_dir(manifest.step), manifest.objects_for(0)
    used = set(tensor_keys(tree))
    tensors = {}
    for key in used:
        entry = manifest.tensors[key]
        chunks = [c for c in entry.chunks if c.ranks is None or 0 in c.ranks]
        whole = torch.empty(entry.shape, dtype=entry.torch_dtype)
        fill(directory.storage, folder, key, entry, chunks, whole, [0] * len(entry.shape))
        tensors[key] = whole
    per_rank = sorted(
        {k for k, e in manifest.tensors.items() if any(c.ranks for c in e.chunks)}
        | (set(manifest.tensors) - used)  # tensors only other ranks' state refers to
    )
    if per_rank or len(manifest.objects) > 1:
        warnings.warn(
            f"{directory.path} step {manifest.step} holds values that differ between ranks "
            f"(tensors {per_rank[:5]}, {len(manifest.objects)} versions of the non-tensor "
            "state); a DCP checkpoint holds one value per key, so rank 0's are converted",
            stacklevel=2,
        )
    access = Access.from_env()
    access.makedirs(dst)
    # DCP's writer creates files as the umask says: it writes them into a folder only
    # this user can open (mkdtemp: 0700), and each moves out once its mode is set.
    staging = tempfile.mkdtemp(prefix=".unbroken-", dir=dst)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            writer = FileSystemWriter(staging)
            dcp.save(decode(tree, tensors), storage_writer=writer, no_dist=True)
        for name in sorted(os.listdir(staging), key=lambda n: n == DCP_METADATA):  # it last
            os.chmod(os.path.join(staging, name), access.file_mode)
            os.replace(os.path.join(staging, name), os.path.join(dst, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return len(tensors)


def _dcp_file(shard: str) -> str:
    match = _SHARD_FILE.match(shard)
    rank, index = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    return f"__{rank}_{index}.distcp"


def _write_dcp_file(
    directory: Directory, folder: str, dst: str, name: str,
    items: Iterable[tuple[MetadataIndex, Where]], access: Access,
) -> dict[MetadataIndex, _StorageInfo]:  # fmt: skip
    """Write ``items`` (read and verified from ``folder``) into ``dst/name`` as DCP's
    FileSystemWriter does: torch.save for tensors, bytes items as they are."""
    found = {}
    fd = access.open(os.path.join(dst, name), os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "wb") as out:
        for index, item in items:
            data = read_chunk(directory.storage, folder, item.key, item.entry, item.chunk)
            start = out.tell()
            if index.offset is None:  # a bytes item
                out.write(byte_view(data))
            else:
                torch.save(data, out)
            found[index] = _StorageInfo(name, start, out.tell() - start)
        out.flush()
        os.fsync(out.fileno())
    return found


def _publish(path: str, data: bytes, access: Access) -> None:
    """Write ``path`` durably under a temporary name, then rename it into place."""
    tmp = f"{path}.tmp"
    with os.fdopen(access.open(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def command(opts: Any) -> int:
    """``unbroken convert SRC DST --to unbroken|dcp`` (arguments: see unbroken.cli.main)."""
    if opts.to == "unbroken":
        step = 0 if opts.step is None else opts.step
        if opts.trust_pickle:  # one plain line on stderr, before anything is unpickled
            print(f"warning: {unpickling_warning(opts.path)}", file=sys.stderr, flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnpicklingWarning)  # printed above
            n = dcp_to_unbroken(opts.path, opts.dst, step=step, trust_pickle=opts.trust_pickle)
        print(f"converted {n} DCP items into step {step} of {opts.dst}")
    else:
        n = unbroken_to_dcp(opts.path, opts.dst, step=opts.step, force=opts.force)
        print(f"converted {n} items into the DCP checkpoint {opts.dst}")
    return 0
