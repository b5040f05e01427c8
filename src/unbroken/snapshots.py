"""Snapshots cheap enough to take every step.

`Checkpointer.snapshot` keeps only the copy on the caller's thread: the state goes into a
free shared-memory slot, a plain memcpy. Checksumming that copy and publishing it (the
slot's JSON, written last: only then may a restore use it) run on a thread of their own,
one snapshot after the other; replication to the peers then runs on the save worker, in
the order the caller took the snapshots, so every rank issues the same collectives in the
same order.

Slots (see `unbroken.memory.OWN_SLOTS`): the newest whole snapshot is never overwritten,
nor one still being checksummed or sent. The next snapshot takes a third slot, so snapshot
N+1 never waits for the checksum or the replication of N; snapshot N+2 waits until N is
done (training cannot outrun its snapshots for long). What this costs: up to three copies
of a rank's state in /dev/shm instead of two; the third is mapped only when a snapshot
comes while the one before is still in flight.

What a crash loses: a snapshot becomes visible once it is published. A process killed
right after `snapshot` returned may come back from the step before (its slot is whole);
it never comes back from a torn or unverified copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from unbroken import replicas
from unbroken.background import SaveThread, wait_for
from unbroken.dist import Comm
from unbroken.format import Chunk, Manifest, TensorEntry, checksum, dtype_name
from unbroken.memory import OWN_SLOTS, MemoryTier
from unbroken.shards import byte_view, local_block, packed
from unbroken.state import capture

Block = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]  # key, data, offsets, shape


@dataclass
class Copied:
    """A snapshot copied into own slot ``slot``, not yet checksummed nor published:
    ``blocks`` hold the views into the slot's buffer, ``starts`` their byte offsets."""

    step: int
    slot: int
    size: int
    blocks: list[Block]
    starts: list[int]


def blocks_of(state: Any) -> tuple[list[Block], dict[str, Any]]:
    """The local blocks of ``state``'s tensors (live, CPU or CUDA) and its JSON tree."""
    tensors, tree = capture(state)
    out = []
    for key, t in tensors.items():
        local, offsets = local_block(t)
        out.append((key, local, offsets, tuple(t.shape)))
    return out, tree


def copy(memory: MemoryTier, step: int, blocks: Sequence[Block]) -> Copied:
    """Copy ``blocks`` into a free own slot (taken until ``memory.own.release``)."""
    starts, total = packed(t.nbytes for _, t, _, _ in blocks)
    slot, buffer = memory.own.begin(total)
    try:
        views = []
        for (key, t, offsets, shape), start in zip(blocks, starts, strict=True):
            view = buffer[start : start + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append((key, view, offsets, shape))
    except BaseException:
        memory.own.release(slot)
        raise
    return Copied(step, slot, buffer.numel(), views, starts)


def seal(memory: MemoryTier, copied: Copied, tree: dict[str, Any]) -> None:
    """Checksum the copy and publish its slot: from now on a restore may use it."""
    file = f"slot-{copied.slot}.bin"
    tensors = {}
    for (key, view, offsets, shape), start in zip(copied.blocks, copied.starts, strict=True):
        chunk = Chunk(
            offsets=list(offsets),
            shape=list(view.shape),
            file=file,
            start=start,
            end=start + view.nbytes,
            xxh3=checksum(byte_view(view)),
        )
        tensors[key] = TensorEntry(dtype=dtype_name(view.dtype), shape=list(shape), chunks=[chunk])
    manifest = Manifest(
        step=copied.step,
        world_size=memory.world_size,
        created=time.time(),
        tensors=tensors,
        objects=[tree],
        rank_objects=[0] * memory.world_size,
        files={file: copied.size},
    )
    memory.own.publish(copied.slot, manifest.to_json().decode())


class Snapshots:
    """The snapshots of one checkpointer: copies on the caller's thread, checksums and
    publishing on a thread per snapshot (each after the one before), replication to
    ``partners`` and from ``sources`` on the save ``worker``. A failure in the background
    goes to ``failed(step, error)``."""

    def __init__(
        self,
        memory: MemoryTier,
        comm: Comm,
        worker: SaveThread,
        partners: list[int],
        sources: list[int],
        failed: Callable[[int, BaseException], None],
    ) -> None:
        self.memory, self._comm, self._worker = memory, comm, worker
        self._partners, self._sources, self._failed = partners, sources, failed
        self._sealed: Future[None] | None = None  # the newest snapshot's seal
        self._holding: list[Future[None]] = []  # jobs holding an own slot, oldest first

    @property
    def replicated(self) -> bool:
        return bool(self._partners or self._sources)

    def take(self, step: int, state: Any) -> Future[None]:
        """Copy ``state`` as ``step`` and start sealing it (and replicating it); returns
        the future of the last background job for this snapshot."""
        self._holding = [f for f in self._holding if not f.done()]
        # A free slot needs the newest whole one kept and at most OWN_SLOTS - 2 in flight.
        while len(self._holding) > OWN_SLOTS - 2:
            wait_for([self._holding.pop(0)], f"snapshot of step {step}: waiting for a slot")
        blocks, tree = blocks_of(state)
        copied = copy(self.memory, step, blocks)
        sealed: Future[None] = Future()
        threading.Thread(
            target=self._seal,
            args=(copied, tree, self._sealed, sealed),
            name=f"unbroken-snapshot-{step}",
            daemon=True,
        ).start()
        self._sealed = sealed
        last = self._worker.submit(self._replicate, copied, sealed) if self.replicated else sealed
        self._holding.append(last)
        return last

    def _seal(
        self, copied: Copied, tree: dict[str, Any], before: Future[None] | None,
        sealed: Future[None],
    ) -> None:  # fmt: skip
        """Runs on a thread of its own: publish after the snapshot before (the newest
        slot must hold the newest step), then say so."""
        if before is not None:
            futures.wait([before])
        try:
            seal(self.memory, copied, tree)
            sealed.set_result(None)
        except BaseException as e:
            self._failed(copied.step, e)
            sealed.set_exception(e)
        finally:
            if not self.replicated:
                self.memory.own.release(copied.slot)

    def _replicate(self, copied: Copied, sealed: Future[None]) -> None:
        """Runs on the save worker, in the order of the snapshots (every rank issues the
        same collectives in the same order), once the snapshot is published."""
        step = copied.step
        try:
            futures.wait([sealed])
            if sealed.exception() is not None:
                return  # recorded already; the peers time out in their own replication
            replicas.replicate(self._comm, self.memory, step, self._partners, self._sources)
            self.memory.free_older(step)  # complete on every rank: older leftovers can go
        except BaseException as e:
            self._failed(step, e)
            raise
        finally:
            self.memory.own.release(copied.slot)
