"""The read stage of a restore: what this rank reads into which memory, reading it from
the chosen source (while serving the replicas this rank keeps for others), and sharing
the tensors one rank read for all (``replicated_reads="broadcast"`` or ``"slice"``).

Nothing read may stay in the live state if the restore fails, on this rank or another
(`unbroken.restoring.pipeline`). Live memory a read writes before the ranks agree is backed up
first (`Backup`); a source that holds what it read until then (S3: `Source.holds`) costs
no backup, and its bytes are placed once every rank has read and checked its part.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from unbroken.format.blockio import start
from unbroken.format.layout import Chunk, Manifest, TensorEntry, checksum, verify_block
from unbroken.format.shards import byte_view
from unbroken.job.comm import Comm
from unbroken.memory import replicas
from unbroken.memory.tier import MemoryTier
from unbroken.restoring.sources import Fill
from unbroken.restoring.step_choice import Choice


@dataclass(frozen=True)
class Target:
    """A saved tensor this rank restores: into ``dest`` (None: a new tensor), whose
    part held here is ``region`` at ``offsets``, from the stored ``chunks``."""

    key: str
    entry: TensorEntry
    dest: torch.Tensor | None
    region: torch.Tensor | None
    offsets: list[int]
    chunks: list[Chunk]


@dataclass
class Reads:
    """This rank's reads: ``fills`` from its source; ``loaded``, every restored tensor by
    key; ``buffers``, the CPU buffers of the tensors shared by broadcast."""

    fills: list[Fill] = field(default_factory=list)
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def plan(comm: Comm, targets: Sequence[Target], readers: dict[str, int]) -> Reads:
    """What this rank reads, and where each tensor lands (``readers``: see `readers`)."""
    reads = Reads()
    first: dict[tuple[Any, ...], Target] = {}  # live memory -> the target that fills it
    for t in targets:
        dest, region = t.dest, t.region
        if dest is not None and region is not None and region.numel() and t.key not in readers:
            twin = first.setdefault(memory(region), t)
            if twin is not t and twin.chunks == t.chunks:  # tied, stored once: read once
                reads.loaded[t.key] = dest
                continue
        if t.key in readers:  # read by one rank, then broadcast: needs a CPU buffer
            reads.buffers[t.key] = region = _cpu_buffer(dest, t.entry)
            dest = region if dest is None else dest
            if readers[t.key] != comm.rank:
                reads.loaded[t.key] = dest
                continue
        elif dest is None:
            dest = region = torch.empty(t.entry.shape, dtype=t.entry.torch_dtype)
        assert region is not None
        reads.loaded[t.key] = dest
        reads.fills.append(
            Fill(t.key, t.entry, t.chunks, region, t.offsets, shared=t.key in readers)
        )
    return reads


def memory(region: torch.Tensor) -> tuple[Any, ...]:
    """Identifies the memory a region covers: tied tensors share it."""
    return region.data_ptr(), region.dtype, tuple(region.shape), region.stride()


def read(
    comm: Comm, memory_tier: MemoryTier | None, choice: Choice, manifest: Manifest,
    files: set[str], fills: Sequence[Fill], threads: int,
) -> Callable[[], None] | None:  # fmt: skip
    """Read ``fills`` from the chosen source while serving the replicas this rank
    provides and checking that ``files`` (all this rank's targets need) are whole;
    returns what places the bytes the source held (see `Source.read`)."""
    sending = comm.start([])
    if choice.serves and memory_tier is not None:
        sending = replicas.send(comm, memory_tier, choice.step, choice.serves)
    checking = start(lambda: choice.source.check(manifest, files))
    try:
        place = choice.source.read(manifest, fills, threads)
    finally:
        checking.result()  # a missing or short file is named as such, not as a failed read
    sending.wait()
    return place


def share(
    comm: Comm, choice: Choice, manifest: Manifest, readers: dict[str, int], reads: Reads
) -> None:
    """Broadcast each tensor from the rank that read it (every rank, in one order: the
    read stage succeeded everywhere), then check what arrived."""
    for key in sorted(readers):
        comm.broadcast_bytes(byte_view(reads.buffers[key]), readers[key])

    def receive() -> None:
        for key, reader in readers.items():
            buffer = reads.buffers[key]
            if reader != comm.rank:
                what = f"{choice.source.where}: tensor {key!r} from rank {reader}"
                verify_block(byte_view(buffer), manifest.tensors[key].chunks[0].xxh3, what)
            if reads.loaded[key] is not buffer:
                reads.loaded[key].copy_(buffer)

    comm.together(f"receiving step {choice.step}", receive)


def readers(comm: Comm, targets: Sequence[Target], mode: str) -> dict[str, int]:
    """For ``replicated_reads`` other than "each": which rank reads each tensor that every
    rank restores whole from one stored block (DDP parameters, optimizer state). The
    others receive it by broadcast instead of fetching the same bytes from storage."""
    if mode == "each" or comm.world_size == 1:
        return {}
    sizes = {
        t.key: t.chunks[0].nbytes
        for t in targets
        if len(t.chunks) == 1
        and t.chunks[0].ranks is None
        and t.chunks[0].shape == t.entry.shape
        and not isinstance(t.dest, DTensor)
    }
    # Only if every rank restores the same set: otherwise each reads its own.
    digest = checksum(memoryview(json.dumps(sorted(sizes)).encode()))
    if len(set(comm.all_gather(digest))) > 1:
        return {}
    if mode == "broadcast":
        return dict.fromkeys(sizes, 0)
    load = [0] * comm.world_size
    chosen = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):  # "slice": balance the bytes
        rank = min(range(comm.world_size), key=lambda r: (load[r], r))
        chosen[key] = rank
        load[rank] += sizes[key]
    return chosen


def _cpu_buffer(dest: torch.Tensor | None, entry: TensorEntry) -> torch.Tensor:
    """``dest`` itself if a broadcast can land in it, else a new CPU tensor."""
    if (
        dest is not None
        and dest.device.type == "cpu"
        and dest.is_contiguous()
        and dest.dtype == entry.torch_dtype
    ):
        return dest
    return torch.empty(entry.shape, dtype=entry.torch_dtype)
