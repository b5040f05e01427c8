"""Snapshots cheap enough to take every step.

`Checkpointer.snapshot` keeps only the copy on the caller's thread: the state goes into a
free shared-memory slot, a plain memcpy (`copy`). Checksumming that copy and publishing it
(`seal`: the slot's JSON, written last, and only then may a restore use it) run on a
thread of their own, one snapshot after the other (`Sealer`); replication to the peers
then runs on the save worker, in the order the caller took the snapshots, so every rank
issues the same collectives in the same order.

Slots (see `unbroken.memory.tier.OWN_SLOTS`): the newest whole snapshot is never overwritten,
nor one still being checksummed or sent, nor, with replicas, the newest one the peers
hold a replica of (`Slots.keep`: else a node lost while step N is sent leaves its ranks
only N-1 in their peers' memory, and the others only N and N+1 in theirs). The next
snapshot takes a third slot, so snapshot N+1 never waits for the replication of N;
snapshot N+2 waits until N is done (training cannot outrun its snapshots for long). What
this costs: up to three copies of a rank's state in /dev/shm instead of two; the third is
mapped only when a snapshot comes while the one before is still in flight.

What a crash loses: a snapshot becomes visible once it is published. Snapshot N+1 waits
for N to be published, which it is unless its checksum took longer than the training
step in between (the background is then behind anyway): a process killed right after
`snapshot` returned comes back from that step or the one before, never from older; it
never comes back from a torn or unverified copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from unbroken.errors import CheckpointError
from unbroken.format.layout import Chunk, Manifest, TensorEntry, checksum, dtype_name
from unbroken.format.shards import byte_view, local_block, packed
from unbroken.job import overlap
from unbroken.job.background import SaveThread, wait_for
from unbroken.job.comm import Comm
from unbroken.memory import replicas
from unbroken.memory.tier import OWN_SLOTS, Block, MemoryTier
from unbroken.run import faults
from unbroken.state import capture


def blocks_of(state: Any) -> tuple[list[Block], dict[str, Any]]:
    """The local blocks of ``state``'s tensors (live, CPU or CUDA) and its JSON tree."""
    tensors, tree = capture(state)
    out = []
    for key, t in tensors.items():
        local, offsets = local_block(t)
        out.append((key, local, offsets, tuple(t.shape)))
    return out, tree


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
        overlap: bool = False,
    ) -> None:
        self.memory, self._comm, self._worker = memory, comm, worker
        self.overlap = overlap  # defer what only an optimizer step changes (`copy`)
        self._partners, self._sources, self._failed = partners, sources, failed
        self._sealer = Sealer()
        self._holding: list[Future[None]] = []  # jobs holding an own slot, oldest first
        self._sealed: Future[None] | None = None  # the newest snapshot's publishing
        self._cache: dict[Any, Any] = {}  # see `copy`

    @property
    def replicated(self) -> bool:
        return bool(self._partners or self._sources)

    def make_room(self, step: int) -> None:
        """Wait for what snapshot ``step`` needs of the ones before: a free slot (the
        newest whole one kept, at most OWN_SLOTS - 2 in flight) and the one before
        published (once ``step`` is taken, a crash finds that one whole). A failure among
        them is reported to ``failed`` before this returns: the caller raises it before
        a slot is overwritten (after a lost peer, every slot may be a rank's last copy)."""
        self._holding = [f for f in self._holding if not f.done()]
        while len(self._holding) > OWN_SLOTS - 2:
            wait_for([self._holding.pop(0)], f"snapshot of step {step}: waiting for a slot")
        if self._sealed is not None:
            wait_for([self._sealed], f"snapshot of step {step}: publishing the one before")

    def take(self, step: int, state: Any) -> Future[None]:
        """Copy ``state`` as ``step`` (after `make_room`) and start sealing it (and
        replicating it); returns the future of the last background job for it."""
        blocks, tree = blocks_of(state)
        try:
            copied = copy(self.memory, step, blocks, self._cache, self.overlap)
        except OSError as e:  # the snapshot before is untouched: it stays the newest
            need = sum(t.nbytes for _, t, _, _ in blocks)
            raise CheckpointError(
                f"{self.memory.dir}: no room for the snapshot of step {step} ({need} bytes): "
                f"{e.strerror or e}; give the shared-memory file system more room (docker "
                f"--shm-size, a larger /dev/shm or memory_dir), or snapshot less often"
            ) from e
        faults.point("snapshot-copy")
        sealed: Future[None] = Future()
        self._sealer.submit(self._seal, copied, tree, sealed)
        self._sealed = sealed
        last = self._worker.submit(self._replicate, copied, sealed) if self.replicated else sealed
        self._holding.append(last)
        return last

    def _seal(self, copied: Copied, tree: dict[str, Any], sealed: Future[None]) -> None:
        """Runs on the sealer, in the order of the snapshots: the newest published slot
        holds the newest step."""
        error: BaseException | None = None
        try:
            faults.point("snapshot-seal")
            torn = copied.copy.verdict(f"snapshot {copied.step}") if copied.copy else None
            if torn:
                raise CheckpointError(f"the snapshot of step {copied.step}: {torn}")
            seal(self.memory, copied, tree)
        except BaseException as e:
            self._failed(copied.step, e)
            error = e
        if not self.replicated:  # free before saying so: the next snapshot may take it
            self.memory.own.release(copied.slot)
        if error is None:
            sealed.set_result(None)
        else:
            sealed.set_exception(error)

    def _replicate(self, copied: Copied, sealed: Future[None]) -> None:
        """Runs on the save worker, in the order of the snapshots (every rank issues the
        same collectives in the same order), once the snapshot is published."""
        step = copied.step
        try:
            futures.wait([sealed])
            if sealed.exception() is not None:
                return  # recorded already; the peers time out in their own replication
            replicas.replicate(self._comm, self.memory, step, self._partners, self._sources)
            self.memory.own.keep(copied.slot)
            self.memory.free_older(step)  # complete on every rank: older leftovers can go
        except BaseException as e:
            self._failed(step, e)
            raise
        finally:
            self.memory.own.release(copied.slot)


class Sealer:
    """One thread running the calls given to it in order, started on demand and gone
    after ``IDLE_S`` without work: no thread outlives a checkpointer for long, and a
    snapshot every step never pays for starting one (milliseconds on a busy machine)."""

    IDLE_S = 30.0

    def __init__(self) -> None:
        self._queue: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._cond = threading.Condition()
        self._running = False

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._cond:
            self._queue.append((fn, args))
            self._cond.notify()
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="unbroken-snapshots", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._cond.wait(self.IDLE_S)
                if not self._queue:
                    self._running = False
                    return
                fn, args = self._queue.pop(0)
            fn(*args)  # the calls catch their own errors (see Snapshots._seal)


@dataclass
class Copied:
    """A snapshot copied into own slot ``slot``, not yet checksummed nor published:
    ``blocks`` hold the views into the slot's buffer, ``starts`` their byte offsets."""

    step: int
    slot: int
    size: int
    blocks: list[Block]
    starts: list[int]
    copy: overlap.Copy | None = None  # the copies the next optimizer step waits for


def copy(
    memory: MemoryTier,
    step: int,
    blocks: Sequence[Block],
    cache: dict[Any, Any] | None = None,
    overlapped: bool = False,
) -> Copied:
    """Copy ``blocks`` into a free own slot (taken until ``memory.own.release``). With a
    ``cache`` (the same dict on every call), a layout seen before reuses its offsets and
    its views into a slot: a snapshot every step then costs little beyond the copy.
    ``overlapped``: what only an optimizer step changes is copied beside the training
    that follows, and checked before the seal (`unbroken.job.overlap`)."""
    cache = {} if cache is None else cache
    layout = [(t.dtype, t.shape) for _, t, _, _ in blocks]
    known = cache.get("layout")
    if known is None or known[0] != layout:
        known = cache["layout"] = (layout, *packed(t.nbytes for _, t, _, _ in blocks))
    layout, starts, total = known
    slot, buffer = memory.own.begin(total)
    try:
        hit = cache.get(slot)
        if hit is None or hit[0] is not layout or hit[1] != buffer.data_ptr():
            views = [
                buffer[start : start + t.nbytes].view(t.dtype).view(t.shape)
                for (_, t, _, _), start in zip(blocks, starts, strict=True)
            ]
            hit = cache[slot] = (layout, buffer.data_ptr(), views)
        live = [t for _, t, _, _ in blocks]
        deferred = overlap.deferred(live) if overlapped else [False] * len(live)
        later = []
        for view, (key, t, _, _), defer in zip(hit[2], blocks, deferred, strict=True):
            if defer:
                later.append((key, view, t))
            else:
                view.copy_(t)
    except BaseException:
        memory.own.release(slot)
        raise
    copied = [(key, v, o, shape) for v, (key, _, o, shape) in zip(hit[2], blocks, strict=True)]
    pending = None
    if later:
        keys, into, sources = zip(*later, strict=True)
        pending = overlap.Copy(keys, sources, list(zip(into, sources, strict=True)), None)
    return Copied(step, slot, buffer.numel(), copied, starts, pending)


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
    memory.own.publish(copied.slot, manifest.to_json().decode(), manifest)
