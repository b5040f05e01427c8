"""`Checkpointer`: save and restore the full training state, on one rank or many,
synchronously or in the background."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from unbroken.errors import CheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import Manifest
from unbroken.healing.stepper import Stepper
from unbroken.job import abort
from unbroken.job import overlap as overlapped
from unbroken.job.background import PendingSave, SaveThread, wait_for
from unbroken.job.comm import Comm
from unbroken.memory import paths, placement
from unbroken.memory.snapshots import Snapshots
from unbroken.options import Options
from unbroken.policies import SavePolicy
from unbroken.preemption import Preemption
from unbroken.restoring import pipeline as restoring
from unbroken.restoring.sources import Restored
from unbroken.retention import KeepLast, Retention
from unbroken.run import worker
from unbroken.saving import pipeline as saving
from unbroken.saving.at_exit import at_exit
from unbroken.saving.committed import Collector
from unbroken.saving.decisions import Cadence
from unbroken.saving.staging import Stager
from unbroken.sdc import Replicated
from unbroken.state import capture
from unbroken.storage import Storage, open_storage

log = logging.getLogger("unbroken")


@worker.instrument  # saves, snapshots and persists timed in the goodput event log
class Checkpointer:
    """Sharded, atomic, checksummed checkpoints of a training job's state.

    >>> ckpt = Checkpointer("runs/exp1")
    >>> ckpt.save(step, {"model": model, "optim": optim, "rng": RNGState()})
    >>> step = ckpt.restore(state)  # newest committed step, loaded in place, or None

    Under torch.distributed, construct it on every rank (it creates its own gloo group for
    coordination) and call `save`/`restore` on every rank. ``path`` must be storage every
    rank sees (a shared file system) when ranks run on several nodes.

    Args:
        path: a directory (created if missing), or ``s3://bucket/prefix``, or any URL
            fsspec knows (``gs://``, ``az://``, ``memory://``...).
        storage_options: for S3, the fields of `unbroken.storage.s3.S3Options`
            (endpoint, region, path_style, credentials, part_size, concurrency,
            timeouts); for fsspec URLs, arguments of the file system.
        replicated: `unbroken.sdc.Replicated`; the others (keep, policy...): `unbroken.options`.
        overlap: copy parameters and optimizer state beside the next forward and backward
            (`unbroken.job.overlap`); off for a loop that changes them outside a step.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        keep: int | Retention | None = None,
        policy: SavePolicy | None = None,
        preemption: Preemption | None = None,
        process_group: dist.ProcessGroup | None = None,
        timeout: float = 600.0,
        io_threads: int = 2,
        staging_buffers: int = 1,
        if_busy: Literal["wait", "skip"] = "wait",
        on_error: Literal["raise", "warn"] = "raise",
        replicated_reads: Literal["each", "broadcast", "slice"] = "each",
        memory: bool = False,
        replicas: int = 0,
        memory_dir: str | None = None,
        job: str | None = None,
        replicated: Replicated | None = None,
        overlap: bool = True,
    ) -> None:
        Options(
            keep=keep, io_threads=io_threads, staging_buffers=staging_buffers, if_busy=if_busy,
            on_error=on_error, replicated_reads=replicated_reads, memory=memory,
            replicas=replicas,
        )  # fmt: skip
        self.path = os.fspath(path)
        self.keep = KeepLast(keep) if isinstance(keep, int) else keep
        self.io_threads = io_threads
        self.overlap = overlap
        self.if_busy = if_busy
        self.on_error = on_error
        self.replicated_reads = replicated_reads
        self.replicated = replicated or Replicated()  # replicas compared: `unbroken.sdc`
        self.storage = open_storage(self.path, storage_options)
        wait = timedelta(seconds=timeout)
        self._comm = Comm(process_group, wait)
        self._collector = Collector(self._directory, self.keep, active=self.rank == 0)
        self._cadence = Cadence(policy, preemption, process_group, wait, self._comm.world_size)
        self._rollback: int | None = None  # the step restored, until the next save
        self._stager = Stager(staging_buffers)
        self._replicating: Future[Any] | None = None
        self._snapshots: Snapshots | None = None  # made by the first `snapshot`
        self._job = job or paths.job_name(self.path)
        self._placement = placement.place(self._comm, self._job, memory, memory_dir, replicas)
        self._memory = self._placement.memory
        self._stepper = Stepper(self._comm, self._job, *self._placement.records)
        # One thread persists saves in order: the same collectives in the same order on
        # every rank, on the checkpointer's own group, never the training loop's.
        self._worker = SaveThread()
        self._pending: list[PendingSave] = []
        self._failure: tuple[int, BaseException, str] | None = None  # step, error, what
        self._lock = threading.Lock()
        self._closed = False
        # The last `restore`'s step and each rank's origin (None: none, or nothing found).
        self.last_restore: Restored | None = None
        at_exit(self)
        abort.register(self)

    @property
    def rank(self) -> int:
        return self._comm.rank

    # -- the directory -------------------------------------------------------------

    @property
    def storage(self) -> Storage:
        """Where the checkpoints live; a replacement (a wrapper) serves from the next call."""
        return self._directory.storage

    @storage.setter
    def storage(self, storage: Storage) -> None:
        self._directory = Directory(storage, self.path)
        if hasattr(self, "_collector"):
            self._collector.directory = self._directory

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Directories without a manifest are not listed."""
        return self._directory.steps()

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest committed step)."""
        return self._directory.manifest(step)

    # -- save ------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        blocking: bool = True,
        metric: float | None = None,
    ) -> PendingSave:
        """Save ``state`` as ``step``. Collective: every rank calls it with the same step.

        ``state`` maps names to Stateful objects (modules, optimizers, schedulers,
        `RNGState`, `Progress`...), tensors and JSON values.

        ``blocking=True`` returns once the checkpoint is committed. ``blocking=False``
        returns once the state is captured: **from then on the loop may modify every
        tensor and Stateful in ``state``** (``overlap``: what only the next optimizer
        step changes is copied meanwhile), written and committed in the background
        (`PendingSave`). A failed save leaves every committed checkpoint as it was.
        ``metric`` (a loss...) is what `KeepBest` ranks by. A committed step, or one
        below the newest committed, is refused, unless this job restored an older step:
        its next save then retires the steps above it (README, "Steps that go backwards")."""
        self._check(step)
        worker.tick(step)
        overlapped.settle()  # the last save's copies: before this one waits for an arena
        self._surface_failure()
        layouts = self._stepper.observe(state, self._memory)
        arena = None if blocking else self._stager.acquire(wait=self.if_busy == "wait")
        try:
            if arena is None and not blocking:
                log.info("rank %d: skipping step %d, a save is persisting", self.rank, step)
                staged = saving.skipped(step)
            else:
                known = self.replicated.known(state, self._stepper.tracker.wrappers(state))
                staged = saving.stage(step, state, arena, known, self.overlap)
            staged.metric, staged.rollback_from, staged.layouts = metric, self._rollback, layouts
            self._rollback = None
        except BaseException as e:
            if arena is not None:
                self._stager.release(arena)
            # Take part in this step's save, failing: the other ranks fail too, not wait.
            self._submit(saving.failed(step, e), background=False)
            raise
        handle = self._submit(staged, background=not blocking)
        if blocking:
            handle.wait()
        return handle

    def _check(self, step: int) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, not {step!r}")

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Ready the staging of background saves of ``state`` (restored, or stepped once)
        in the background: the first ``save(blocking=False)`` blocks no longer than later."""
        self._stager.reserve_for(state)

    def _submit(self, staged: saving.Staged, background: bool) -> PendingSave:
        future = self._worker.submit(self._persist, staged, background)
        handle = PendingSave(staged.step, future, self._seen)
        with self._lock:
            self._pending = [p for p in self._pending if not p.done()] + [handle]
        return handle

    def _persist(self, staged: saving.Staged, background: bool) -> bool:
        """Runs on the worker. A background failure is logged at once and kept for the
        next `save` or `wait`; a blocking one is raised to the caller only."""
        try:
            threads = 1 if background else self.io_threads  # background: a core at most
            context = saving.SaveContext(
                comm=self._comm, directory=self._directory, io_threads=threads,
                collector=self._collector, job=self._job, replicated=self.replicated,
            )  # fmt: skip
            return saving.persist(context, staged)
        except BaseException as e:
            if background and not self._closed:  # abandoned: nobody is told any more
                log.error("saving step %d failed: %s", staged.step, e)
                with self._lock:
                    self._failure = (staged.step, e, "the background save")
            raise
        finally:
            if staged.arena is not None:
                self._stager.release(staged.arena)

    def _seen(self, step: int) -> None:
        with self._lock:
            self._failure = None if self._failure and self._failure[0] == step else self._failure

    def _surface_failure(self) -> None:
        """Raise (or warn about) a background save that failed since the last call."""
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is None:
            return
        step, error, what = failure
        message = f"{what} of step {step} failed: {error}"
        if self.on_error == "warn":
            warnings.warn(f"{message}; training goes on", stacklevel=3)
            return
        raise CheckpointError(message) from error

    def wait(self) -> None:
        """Wait until every save started so far is committed, skipped or failed, and raise
        a failure the way the next `save` would."""
        self._drain()
        self._collector.wait()
        self._surface_failure()

    def _drain(self) -> None:
        """Wait for the worker to finish what it was given (failures stay recorded)."""
        overlapped.settle()  # it waits for this thread to settle the last save's copies
        with self._lock:
            pending = [p._future for p in self._pending]
        if self._replicating is not None:
            pending.append(self._replicating)
        wait_for(pending, "waiting for background saves")

    def snapshot(self, step: int, state: Mapping[str, Any]) -> None:
        """Keep ``state`` as ``step`` in this node's shared memory: no storage IO, and no
        coordination with other ranks. Restore uses it when every rank holds that step
        and it is at least as new as the newest checkpoint on storage.

        Cheap enough for every step: it copies ``state`` into a free slot (``overlap``, as
        `save`). Checksums, publishing and, with ``replicas``, sending it to peers (every
        rank snapshots the same steps) run in the background (`unbroken.memory.snapshots`):
        a crash after ``snapshot`` returned comes back from it or the one before."""
        if self._memory is None:
            raise CheckpointError("memory snapshots are off; pass Checkpointer(..., memory=True)")
        worker.tick(step)
        self._surface_failure()
        self._stepper.observe(state, self._memory)
        if self._snapshots is None:
            rest = (self._placement.partners, self._placement.sources, self._snapshot_failed)
            self._snapshots = Snapshots(self._memory, self._comm, self._worker, *rest, self.overlap)
        overlapped.settle()  # the last snapshot's copies: make_room waits for its seal
        self._snapshots.make_room(step)
        self._surface_failure()  # what it waited for failed: see `Snapshots.make_room`
        self._replicating = self._snapshots.take(step, state)

    def _snapshot_failed(self, step: int, error: BaseException) -> None:
        """Logged, and kept for the next `snapshot`, `save` or `wait`."""
        if not self._closed:
            log.error("the snapshot of step %d failed: %s", step, error)
        with self._lock:
            self._failure = (step, error, "the snapshot")

    def step(self, step: int, state: Mapping[str, Any]) -> None:
        """Declare ``state`` complete at ``step``: call it after each optimizer step,
        before the step's next collective; every rank, the same steps. It keeps a small
        record of what data-parallel replicas do not share (`Progress`, `RNGState`,
        schedulers, plain values) here and on a peer on another node, in one round trip,
        so that `restore` can heal from live replicas (`unbroken.healing.live`); then beats
        the heartbeat (`unbroken.run.tick`). With a ``policy`` it takes the snapshot or
        save the policy says; with ``preemption``, after a signal, it saves this step,
        blocking, and raises `Preempted`."""
        self._check(step)
        self._stepper.exchange(self._stepper.record(step, state, self._memory))
        worker.tick(step)
        self._cadence.at_step(step, state, self)

    def _saving(self, step: int) -> bool:  # by the loop itself, or a policy
        with self._lock:
            return any(p.step == step for p in self._pending)

    # -- restore ---------------------------------------------------------------------

    def restore(
        self,
        state: MutableMapping[str, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        fallback: bool = True,
    ) -> int | None:
        """Load a step into ``state`` in place and return it.

        ``step=None`` takes the newest step (None, touching nothing, if there is none):
        healed from live replicas after a failure where `step` records exist (origin
        ``"live"``), else the newest step in shared memory or storage. Tensors are read
        in place where possible, Statefuls get ``load_state_dict``, JSON values are
        replaced. Keys, shapes and files are checked on every rank before any byte
        changes; ``strict=False`` skips entries on one side only. A copy failing
        verification (checksum, truncated or missing file) is passed over, loudly, for
        the newest older one that verifies (``fallback=False`` or an explicit ``step``:
        raise); a failed restore leaves ``state`` as it was. Background saves are waited
        for first. Where each rank's state came from: `last_restore`."""
        self._drain()
        worker.event("restore_start")
        live = capture(state)  # once: every stage below takes the state's tensors from it
        healed = self._stepper.heal(state, live) if step is None else None
        if healed is None:
            with self._collector.paused():
                context = restoring.RestoreContext(
                    comm=self._comm, directory=self._directory, io_threads=self.io_threads,
                    replicated_reads=self.replicated_reads, memory=self._memory,
                )  # fmt: skip
                healed = restoring.restore(context, state, live, step, strict, fallback)
        self.last_restore = healed
        for bad in () if healed is None else healed.damaged:
            if bad.kind == "storage":
                self._collector.damaged(bad.step)
        self._rollback = None if healed is None else healed.step
        self._stepper.restored(self._rollback, state, self._memory, self._directory)  # collective
        worker.event("restore_done", step=self._rollback)
        return self._rollback

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Wait for background saves, then release the checkpointer's process group."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._stepper.stop()
            self._collector.close()
            self._cadence.close()
            self._stepper.forget()  # the job is over here: nothing left to heal
            self._worker.shutdown(wait=True)
            self._comm.close()

    def _abandon(self) -> list[Future[Any]]:
        """Stop using this checkpointer without talking to the other ranks (its group
        is broken) and without waiting: cancel queued work; the saves still running
        (`unbroken.job.abort.settle` lets the next save wait for them)."""
        if self._closed:
            return []
        self._closed = True
        self._stepper.stop()
        with self._lock:
            running = [p._future for p in self._pending if not p._future.done()]
        self._worker.shutdown(wait=False, cancel=True)
        return running

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.path!r}, rank={self.rank}/{self._comm.world_size})"
