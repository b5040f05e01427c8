"""The save pipeline: capture and stage in the caller's thread, persist in the background.

Persisting is collective. Its phases, each ending with every rank agreeing:

1. rank 0 gets every rank's blocks and agrees the step (or skipping it); each rank
   hashes the blocks rank 0 says another rank holds too (the plan writes a replicated
   block once, by checksum); rank 0 makes the plan and sends each rank the keys it
   writes, and nothing else (`unbroken.saving.planning`);
2. write: each rank writes the blocks the plan gives it and makes them durable, hashing
   those it alone holds meanwhile (`unbroken.saving.checksums`), and judges its
   overlapped copy (`unbroken.job.overlap`); rank 0 then compares the copies of
   replicated state (`unbroken.sdc`);
3. commit: rank 0 writes the manifest atomically. Only now does the step exist.

An overlapped copy is read (hashed, written) as soon as it has landed, beside the
training that follows the save; only its verdict waits for the next optimizer step,
and nothing is compared or committed before it.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from unbroken.errors import CheckpointError, StorageError
from unbroken.format.blockio import run_all
from unbroken.format.directory import Directory
from unbroken.format.layout import INFO, Chunk, step_dir
from unbroken.format.shards import local_block, write_blocks
from unbroken.job import abort, overlap
from unbroken.job.comm import Comm
from unbroken.retention import Info
from unbroken.run import faults, worker
from unbroken.saving import claims
from unbroken.saving.checksums import Sums, checksums, layout
from unbroken.saving.committed import Collector
from unbroken.saving.planning import Planner, refused
from unbroken.saving.staging import Arena
from unbroken.sdc import Known, Replicated
from unbroken.state import capture

log = logging.getLogger("unbroken")
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class SaveContext:
    """What persisting a save needs: the checkpointer's group, the directory it writes,
    its writer threads per rank, rank 0's index of committed steps (which also applies
    retention)."""

    comm: Comm
    directory: Directory
    io_threads: int
    collector: Collector
    job: str = ""  # names this job's claims on the steps it saves (`unbroken.saving.claims`)
    replicated: Replicated | None = None  # see `unbroken.sdc`


@dataclass(kw_only=True)
class Staged:
    """One save, captured: the blocks to write (live tensors, or copies in an arena)."""

    step: int
    keys: list[str]
    blocks: list[torch.Tensor]  # contiguous, on the CPU once ``ready`` has completed
    offsets: list[tuple[int, ...]]
    shapes: list[tuple[int, ...]]  # global shapes
    tree: dict[str, Any]
    aliases: dict[str, str] = field(default_factory=dict)  # key -> key sharing its storage
    arena: Arena | None = None
    ready: torch.cuda.Event | None = None
    copy: overlap.Copy | None = None  # the copies that wait for the next optimizer step
    skipped: bool = False
    error: str | None = None  # staging failed on this rank
    metric: float | None = None  # for retention (`KeepBest`); rank 0's counts
    rollback_from: int | None = None  # the step restored before, if it may roll back to it
    layouts: dict[str, Any] = field(default_factory=dict)  # DDP buckets: rank 0's go in INFO
    replicated: list[int] = field(default_factory=list)  # blocks known replicated: `sdc.Known`


def stage(
    step: int,
    state: Mapping[str, Any],
    arena: Arena | None,
    known: Known | None = None,
    overlapped: bool = False,
) -> Staged:
    """Capture ``state``; with an ``arena``, copy its tensors there so the caller may change
    them as soon as this returns, but for what only an optimizer step changes: with
    ``overlapped``, that is copied beside the training that follows (`unbroken.job.overlap`).
    Without an arena, the blocks are the live (CPU) tensors. ``known``: what the state
    holds that is replicated, compared at persist (`unbroken.sdc`)."""
    tensors, tree = capture(state)
    faults.point("stage")
    keys, blocks, offsets, shapes = [], [], [], []
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    replicated: list[int] = []
    for i, (key, t) in enumerate(tensors.items()):
        if known is not None and known.holds(key, t):
            replicated.append(i)  # block i: one per key
        local, where = local_block(t)
        if local.numel():  # tied tensors (one storage, two keys) are stored once
            ident = (local.data_ptr(), local.dtype, tuple(local.shape), where, tuple(t.shape))
            if ident in first:
                aliases[key] = first[ident]
            else:
                first[ident] = key
        if arena is None and local.is_cuda:
            local = local.cpu()
        keys.append(key)
        blocks.append(local)
        offsets.append(where)
        shapes.append(tuple(t.shape))
    ready, copy = None, None
    if arena is not None:
        deferred = overlap.deferred(blocks) if overlapped else []
        live = blocks
        blocks, ready = arena.stage(live, deferred)
        copy = _copy(keys, live, blocks, deferred, ready)
    return Staged(
        step=step, keys=keys, blocks=blocks, offsets=offsets, shapes=shapes, tree=tree,
        aliases=aliases, arena=arena, ready=ready, replicated=replicated, copy=copy,
    )  # fmt: skip


def _copy(
    keys: list[str],
    live: list[torch.Tensor],
    copies: list[torch.Tensor],
    deferred: list[bool],
    ready: torch.cuda.Event | None,
) -> overlap.Copy | None:
    """The deferred copies of a save, under way, or None if there are none."""
    picked = [i for i, d in enumerate(deferred) if d]
    if not picked:
        return None
    pairs = [(copies[i], live[i]) for i in picked if not live[i].is_cuda]
    landed = ready if any(live[i].is_cuda for i in picked) else None
    return overlap.Copy([keys[i] for i in picked], [live[i] for i in picked], pairs, landed)


def skipped(step: int) -> Staged:
    """A save this rank skips: it still takes part in the exchange, so every rank skips."""
    return Staged(step=step, keys=[], blocks=[], offsets=[], shapes=[], tree={}, skipped=True)


def failed(step: int, error: BaseException) -> Staged:
    """A save this rank could not stage: it takes part in the exchange, failing it."""
    return Staged(step=step, keys=[], blocks=[], offsets=[], shapes=[], tree={}, error=str(error))


def persist(ctx: SaveContext, staged: Staged) -> bool:
    """Write and commit ``staged``; False if some rank skipped this step. If writing or
    committing fails, rank 0 removes what the ranks wrote (every rank has stopped by
    then: each stage ends with all of them agreeing), unless the step got committed."""
    abort.settle(f"saving step {staged.step}")  # a failed generation's save, still writing
    writing: list[bool] = []
    try:
        return _persist(ctx, staged, writing)
    except BaseException:
        if writing and ctx.comm.rank == 0:
            _remove_failed(ctx, staged.step)
        raise


def _persist(ctx: SaveContext, staged: Staged, writing: list[bool]) -> bool:
    started = time.perf_counter()
    comm, step = ctx.comm, staged.step
    what = f"saving step {step}"
    # Rank 0 plans (`unbroken.saving.planning`): the others send their blocks and get
    # back only what they hash first, then what they write.
    planner = Planner(step=step, replicated=ctx.replicated, storage=ctx.directory.storage)
    refusal, skip, early = comm.planned(
        what, lambda: explained(ctx, what, lambda: _layout(staged)), planner.layout
    )
    refused(refusal)
    if skip:
        return False
    sums: Sums = {}  # this rank's early checksums: the plan's, and its own to write

    def hashed() -> Sums:
        sums.update(_hash(ctx, staged, early))
        return sums

    writes, tags = comm.planned(what, lambda: explained(ctx, what, hashed), planner.writes)
    writing.append(True)
    info = Info(step, time.time(), staged.metric)
    refusal = comm.planned(
        f"writing step {step}",
        lambda: explained(
            ctx, f"writing step {step}", lambda: _write(ctx, staged, writes, tags, sums, info)
        ),
        planner.wrote,
    )
    refused(refusal)
    faults.point("data-written")
    comm.together(
        f"committing step {step}",
        lambda: explained(ctx, f"committing step {step}", lambda: _commit(ctx, info, planner)),
    )
    faults.point("committed")
    if comm.rank == 0:
        ctx.collector.committed(info)  # retention runs on the collector's thread
        try:
            ctx.directory.move_latest(step)
        except Exception as e:  # the step is committed; restore finds it by listing
            log.warning("step %d is committed but the latest pointer did not move: %s", step, e)
        written = sum(size for row in planner.written for size in row[1].values())
        seconds = time.perf_counter() - started
        log.info("saved step %d: %.1f MiB in %.2f s", step, written / 2**20, seconds)
    return True


# What to do about the storage errors a save meets most (tests/test_exhaustion.py).
_ADVICE = {
    errno.ENOSPC: "the file system is full: free space, or keep fewer checkpoints (keep=)",
    errno.EDQUOT: "the disk quota is exceeded: free space, or keep fewer checkpoints (keep=)",
    errno.EACCES: "this process may not write there: check the owner and mode of the path",
    errno.EPERM: "this process may not write there: check the owner and mode of the path",
    errno.EROFS: "the file system is read-only: save somewhere writable",
}


def explained(ctx: SaveContext, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, an `OSError` turned into a `StorageError` that names the checkpoint, the
    step and the rank, and says what to do (the other ranks see this message)."""
    try:
        return fn()
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        where = f", {e.filename}" if e.filename else ""
        advice = _ADVICE.get(e.errno or 0, "see the cause below")
        text = f"{e.strerror or e} ({ctx.directory.path}: {what} on rank {ctx.comm.rank}{where})"
        args = (e.errno, f"{text}; {advice}") if e.errno else (f"{text}; {advice}",)
        raise StorageError(*args) from e


def _remove_failed(ctx: SaveContext, step: int) -> None:
    """Remove what a failed save of ``step`` wrote, unless another writer claimed the
    step meanwhile: its folder is that writer's now."""
    try:
        if ctx.directory.is_committed(step):
            ctx.collector.committed(Info(step, time.time()))
        elif (held := claims.read(ctx.directory.storage, step_dir(step))) and not held.ours():
            log.warning("the failed save of step %d leaves its folder to %s", step, held)
        else:
            ctx.directory.storage.delete(step_dir(step))
    except Exception as e:  # the next Checkpointer to open removes it
        log.warning("could not remove what the failed save of step %d wrote: %s", step, e)


def _layout(staged: Staged) -> list[Any]:
    """What this rank saves, for the plan: the step, whether it skips it, its blocks and
    which of them it knows to be replicated (`unbroken.sdc`). An overlapped copy need not
    have landed: the plan needs only shapes."""
    if staged.error is not None:
        raise CheckpointError(staged.error)
    return [staged.step, staged.skipped, [b.to_json() for b in layout(staged)], staged.replicated]


def _hash(ctx: SaveContext, staged: Staged, keys: list[str]) -> Sums:
    """The checksums of ``keys`` (the blocks other ranks hold too), once the staged copies
    have landed; on rank 0, beside them, clearing the way for the step (`_clear`)."""
    if staged.copy is not None:
        staged.copy.copied(f"saving step {staged.step}")
    if staged.ready is not None:
        staged.ready.synchronize()
    clear = (lambda: _clear(ctx, staged.step, staged.rollback_from)) if ctx.comm.rank == 0 else None
    return checksums(staged, keys, ctx.io_threads, clear)


def _write(
    ctx: SaveContext,
    staged: Staged,
    writes: list[str],
    tags: dict[str, list[int]],
    hashed: Sums,
    info: Info,
) -> list[Any]:
    """Write the blocks of ``writes`` (this rank's part of the plan); meanwhile hash those
    not ``hashed`` yet (the blocks this rank alone holds) and, on rank 0, write the step's
    info. Returns the manifest chunks of ``writes``, in order (`_chunks`), the files'
    sizes and this rank's tree."""
    rank, storage, folder = ctx.comm.rank, ctx.directory.storage, step_dir(info.step)
    mine = set(writes)
    blocks = [(k, t) for k, t in zip(staged.keys, staged.blocks, strict=True) if k in mine]
    later = [k for k, _ in blocks if k not in hashed]
    # The DDP bucket layouts (`unbroken.healing.ddp_buckets`): a restart that finds no
    # shared memory restores from this step and still reduces as the saving run did.
    layouts = {"ddp_layouts": staged.layouts} if staged.layouts else {}
    text = json.dumps({"created": info.created, "metric": info.metric, **layouts}).encode()
    out: dict[str, Any] = {}
    jobs: list[Callable[[], object]] = [  # side by side on the process's IO workers
        lambda: out.update(where=write_blocks(storage, folder, rank, blocks, ctx.io_threads)),
        lambda: out.update(sums=checksums(staged, later, ctx.io_threads)),
    ]
    if rank == 0:
        jobs.append(lambda: storage.write(f"{folder}/{INFO}", [text]))
    run_all(lambda job: job(), jobs, min(len(jobs), ctx.io_threads))
    # The overlapped copy's verdict (`unbroken.job.overlap`), as late as it may be: after
    # the write, before the replicas are compared (`Planner.wrote`) and the step commits.
    if staged.copy is not None and (error := staged.copy.verdict(f"saving step {info.step}")):
        raise CheckpointError(error)
    where, sizes = out["where"]
    return [_chunks(staged, writes, tags, where, hashed | out["sums"]), sizes, staged.tree]


def _chunks(
    staged: Staged,
    writes: list[str],
    tags: dict[str, list[int]],
    where: dict[str, tuple[str, int, int]],
    sums: Sums,
) -> list[str]:
    """The manifest chunk of each key of ``writes`` as `layout.Manifest` stores it, the
    ranks it names from ``tags``: encoded here, by its writer, so that rank 0 only joins
    them (`unbroken.saving.planning`)."""
    index = {key: i for i, key in enumerate(staged.keys)}
    out = []
    for key in writes:
        i, (file, start, end) = index[key], where[key]
        region = list(staged.offsets[i]), list(staged.blocks[i].shape)
        chunk = Chunk(offsets=region[0], shape=region[1], file=file, start=start, end=end,
                      ranks=tags.get(key), **sums[key])  # fmt: skip
        out.append(chunk.to_text())
    return out


def _commit(ctx: SaveContext, info: Info, planner: Planner) -> None:
    """On rank 0, once the step's claim is found still ours: the manifest, from the plan
    and where every rank wrote its blocks and their late checksums."""
    if ctx.comm.rank != 0:
        return
    claims.verify(ctx.directory.storage, ctx.directory.path, info.step)
    manifest = planner.manifest(ctx.comm.world_size, info.created)
    ctx.directory.commit(manifest)


def _clear(ctx: SaveContext, step: int, base: int | None) -> None:
    """Before saving ``step``, on rank 0, from the index (no listing): refuse to replace a
    committed step, or to save below the newest committed one, unless this job restored
    an older step on purpose (``base``): the steps above that one are then an
    abandoned future, retired here, newest first (see the README, "Steps that go
    backwards"). Nobody can be writing them: saves are persisted one at a time."""
    known = ctx.collector.known()
    if base is not None and (abandoned := [s for s in known if s > base]):
        log.warning(
            "%s: saving step %d after restoring step %d: retiring the steps of the "
            "abandoned run above it: %s", ctx.directory, step, base, abandoned,
        )  # fmt: skip
        worker.event("rollback", step=step, restored=base, retired=abandoned)
        for old in reversed(abandoned):
            ctx.directory.delete(old)
            ctx.collector.forget(old)
        known = [s for s in known if s <= base]
    where = ctx.directory.path
    if step in known or ctx.directory.is_committed(step):  # one request: another writer
        raise CheckpointError(
            f"{where}: step {step} is already committed; save under a new step, "
            f"or delete {step_dir(step)} first"
        )
    if known and step < known[-1]:
        raise CheckpointError(
            f"{where}: step {step} is below the newest committed step {known[-1]}; a job "
            f"that rolls back restores the step it goes back to first (restore(state, "
            f"step=...)), and its next save then retires the steps above it"
        )
    claims.stake(ctx.directory.storage, where, step, ctx.job)  # before any rank writes
    if ctx.directory.is_committed(step):  # committed by a writer whose claim was stale
        raise CheckpointError(f"{where}: step {step} was committed by another writer meanwhile")
