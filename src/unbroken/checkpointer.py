"""`Checkpointer`: save and restore the full training state, on one rank or many,
synchronously or in the background."""

from __future__ import annotations

import logging
import os
import socket
import threading
import warnings
from collections.abc import Mapping, MutableMapping
from concurrent import futures
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from unbroken import abort, records, replicas, restoring, saving
from unbroken.background import PendingSave, SaveThread
from unbroken.background import wait_for as _wait
from unbroken.directory import Directory
from unbroken.dist import Comm
from unbroken.errors import CheckpointError
from unbroken.exiting import at_exit as _at_exit
from unbroken.format import Manifest
from unbroken.memory import MemoryTier
from unbroken.memory import replica_layout as layout
from unbroken.options import Options
from unbroken.run import contract, worker
from unbroken.sources import Restored
from unbroken.staging import Stager
from unbroken.stepping import Stepper
from unbroken.storage import Storage, open_storage

log = logging.getLogger("unbroken")


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
        keep: keep only the newest ``keep`` committed checkpoints; ``None`` keeps all.
        process_group: the ranks that checkpoint together; default: all of them.
        timeout: how long a rank waits for the others during save or restore (seconds).
        io_threads: parallel file writers and readers per rank.
        staging_buffers: host copies of the state that background saves may hold at once.
        if_busy: what ``save(blocking=False)`` does when every staging buffer still holds
            a save that is persisting: ``"wait"`` for one to free, or ``"skip"`` this step.
        on_error: what the next ``save()`` does about a background save that failed:
            ``"raise"`` it, or ``"warn"`` and go on.
        replicated_reads: how a restore reads tensors that every rank needs whole (DDP
            parameters and optimizer state): ``"each"`` rank reads them; ``"broadcast"``:
            rank 0 reads them and broadcasts; ``"slice"``: the ranks share the reading
            and broadcast what each read. The last two cut storage traffic by the world
            size, which is what counts on object stores.
        memory: keep `snapshot`s in this node's shared memory (``memory_dir``, default
            ``$UNBROKEN_MEMORY_DIR`` or /dev/shm/unbroken), so a process restarted on the
            same node restores without touching storage.
        replicas: with ``memory``, also keep each snapshot in the shared memory of this
            many peers on other nodes (sent in the background over the checkpointer's
            gloo group), so the ranks of a lost node restore from their peers.
        job: names the job in shared memory, so another job's snapshots are never
            used; default: torchrun's run id, else the checkpoint path.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        keep: int | None = None,
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
    ) -> None:
        Options(
            keep=keep, io_threads=io_threads, staging_buffers=staging_buffers, if_busy=if_busy,
            on_error=on_error, replicated_reads=replicated_reads, memory=memory,
            replicas=replicas,
        )  # fmt: skip
        self.path = os.fspath(path)
        self.keep = keep
        self.io_threads = io_threads
        self.if_busy = if_busy
        self.on_error = on_error
        self.replicated_reads = replicated_reads
        self.storage = open_storage(self.path, storage_options)
        self._comm = Comm(process_group, timedelta(seconds=timeout))
        self._stager = Stager(staging_buffers)
        self._memory: MemoryTier | None = None
        self._replica_partners: list[int] = []  # ranks that keep replicas of this rank
        self._replica_sources: list[int] = []  # ranks this rank keeps replicas of
        self._replicating: Future[Any] | None = None
        self._job = job or os.environ.get("TORCHELASTIC_RUN_ID") or f"path-{self.path}"
        nodes = self._nodes()
        if memory:
            self._open_memory(memory_dir, nodes, replicas)
        # Per-step records go to one rank on another node (its replica partners').
        to, sources = self._replica_partners, self._replica_sources
        if not to and not sources:
            to, sources = layout(nodes, self.rank, 1)
        self._stepper = Stepper(self._comm, self._job, to, sources)
        # One thread persists saves in order: every rank then issues the same collectives
        # in the same order on the checkpointer's own group, never the training loop's.
        self._worker = SaveThread()
        self._pending: list[PendingSave] = []
        self._failure: tuple[int, BaseException] | None = None
        self._lock = threading.Lock()
        self._closed = False
        # The outcome of the last `restore`: its step and where each rank's state came
        # from (None: none yet, or it found nothing to restore).
        self.last_restore: Restored | None = None
        _at_exit(self)
        abort.register(self)

    def _nodes(self) -> list[str]:
        """Every rank's node: what torchrun calls one (its node rank), or a simulated one."""
        node = os.environ.get(contract.NODE_ENV) or os.environ.get("GROUP_RANK")
        return list(self._comm.all_gather(f"{socket.gethostname()}/{node}"))

    def _open_memory(self, memory_dir: str | None, nodes: list[str], replicas: int) -> None:
        """The shared-memory tier and, with ``replicas``, who keeps replicas of whom."""
        root = memory_dir or os.environ.get(contract.MEMORY_DIR_ENV) or contract.DEFAULT_MEMORY_ROOT
        self._memory = MemoryTier(root, self._job, self.rank, self._comm.world_size)
        if replicas:
            self._replica_partners, self._replica_sources = layout(nodes, self.rank, replicas)

    @property
    def rank(self) -> int:
        return self._comm.rank

    # -- the directory -------------------------------------------------------------

    @property
    def storage(self) -> Storage:
        """Where the checkpoints live; a replacement (a wrapper, in tests) is used from
        the next save or restore on."""
        return self._directory.storage

    @storage.setter
    def storage(self, storage: Storage) -> None:
        self._directory = Directory(storage, self.path)

    def _restore_context(self) -> restoring.RestoreContext:
        return restoring.RestoreContext(
            comm=self._comm, directory=self._directory, io_threads=self.io_threads,
            replicated_reads=self.replicated_reads, memory=self._memory,
            replica_sources=tuple(self._replica_sources),
        )  # fmt: skip

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Directories without a manifest are not listed."""
        return self._directory.steps()

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest committed step)."""
        return self._directory.manifest(step)

    # -- save ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, blocking: bool = True) -> PendingSave:
        """Save ``state`` as ``step``. Collective: every rank calls it with the same step.

        ``state`` maps names to Stateful objects (modules, optimizers, schedulers,
        `RNGState`, `Progress`...), tensors and JSON values.

        ``blocking=True`` returns once the checkpoint is committed. ``blocking=False``
        returns as soon as the state is copied into a staging buffer: **from then on the
        training loop may modify every tensor and Stateful in ``state``**; the copy is
        written and committed in the background (see `PendingSave`). Saving a step that is
        already committed is an error; a failed save leaves every committed checkpoint as
        it was.
        """
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, not {step!r}")
        worker.tick(step)
        self._surface_failure()
        self._stepper.observe(state, self._memory)
        arena = None if blocking else self._stager.acquire(wait=self.if_busy == "wait")
        try:
            if arena is None and not blocking:
                log.info("rank %d: skipping step %d, a save is persisting", self.rank, step)
                staged = saving.skipped(step)
            else:
                staged = saving.stage(step, state, arena)
        except BaseException as e:
            if arena is not None:
                self._stager.release(arena)
            # The other ranks are about to save this step: take part, failing, so that
            # they fail too instead of waiting for this rank.
            self._submit(saving.failed(step, e), background=False)
            raise
        handle = self._submit(staged, background=not blocking)
        if blocking:
            handle.wait()
        return handle

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
            context = saving.SaveContext(
                comm=self._comm, directory=self._directory, io_threads=self.io_threads,
                keep=self.keep,
            )  # fmt: skip
            return saving.persist(context, staged)
        except BaseException as e:
            if background and not self._closed:  # abandoned: nobody is told any more
                log.error("saving step %d failed: %s", staged.step, e)
                with self._lock:
                    self._failure = (staged.step, e)
            raise
        finally:
            if staged.arena is not None:
                self._stager.release(staged.arena)

    def _seen(self, step: int) -> None:
        with self._lock:
            if self._failure is not None and self._failure[0] == step:
                self._failure = None

    def _surface_failure(self) -> None:
        """Raise (or warn about) a background save that failed since the last call."""
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is None:
            return
        step, error = failure
        message = f"the background save of step {step} failed: {error}"
        if self.on_error == "warn":
            warnings.warn(f"{message}; training goes on", stacklevel=3)
            return
        raise CheckpointError(message) from error

    def wait(self) -> None:
        """Wait until every save started so far is committed, skipped or failed, and raise
        a failure the way the next `save` would."""
        self._drain()
        self._surface_failure()

    def _drain(self) -> None:
        """Wait for the worker to finish what it was given (failures stay recorded)."""
        with self._lock:
            pending = [p._future for p in self._pending]
        if self._replicating is not None:
            pending.append(self._replicating)
        _wait(pending, "waiting for background saves")

    def snapshot(self, step: int, state: Mapping[str, Any]) -> None:
        """Keep ``state`` as ``step`` in this node's shared memory: no storage IO, and no
        coordination with other ranks. Restore uses it when every rank holds that step
        and it is at least as new as the newest checkpoint on storage. The two newest
        snapshots are kept; writing one never damages the other. With ``replicas``,
        the snapshot then goes to the peers in the background (collective: every rank
        snapshots the same steps); the next snapshot waits until that is done."""
        if self._memory is None:
            raise CheckpointError("memory snapshots are off; pass Checkpointer(..., memory=True)")
        worker.tick(step)
        self._surface_failure()
        if self._replicating is not None:
            # The slot about to be overwritten may be the one still being sent.
            _wait([self._replicating], f"snapshot of step {step}: waiting for replication")
            self._surface_failure()
        self._stepper.observe(state, self._memory)
        staged = saving.stage(step, state, arena=None)
        blocks = zip(staged.keys, staged.blocks, staged.offsets, staged.shapes, strict=True)
        self._memory.write(step, list(blocks), staged.tree)
        if self._replica_partners or self._replica_sources:
            self._replicating = self._worker.submit(self._replicate, self._memory, step)

    def _replicate(self, memory: MemoryTier, step: int) -> None:
        """Runs on the worker, like `_persist`; a failure is logged and kept for the next
        `snapshot`, `save` or `wait`."""
        try:
            replicas.replicate(
                self._comm, memory, step, self._replica_partners, self._replica_sources
            )
            memory.free_older(step)  # complete on every rank: older leftovers can go
        except BaseException as e:
            if not self._closed:
                log.error("replicating the snapshot of step %d failed: %s", step, e)
            with self._lock:
                self._failure = (step, e)
            raise

    def step(self, step: int, state: Mapping[str, Any]) -> None:
        """Declare ``state`` complete at ``step``: call it after each optimizer step,
        before the step's next collective. Cheap, no storage IO: it keeps a small record
        of what data-parallel replicas do not share (`Progress`, `RNGState`, schedulers,
        plain values; not modules or optimizers) in this process and on a peer on another
        node, in one point-to-point round trip, so that when it returns the peer holds the
        step. After a failure, `restore` then heals from live replicas (see
        `unbroken.healing`): healthy ranks keep their state, replacements get it from
        them, and at most the step in flight is lost. Every rank calls it for the same
        steps. Its heartbeat (`unbroken.run.tick`) comes once the peer holds the step."""
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, not {step!r}")
        self._stepper.exchange(self._stepper.record(step, state, self._memory))
        worker.tick(step)

    # -- restore ---------------------------------------------------------------------

    def restore(
        self, state: MutableMapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> int | None:
        """Load a step into ``state`` in place and return it.

        ``step=None`` takes the newest step, and returns None (touching nothing) when
        there is none. After a failure where `step` records exist, the healthy ranks
        keep their live state and replacements heal from it (origin ``"live"``); else
        the newest step in shared memory or storage is loaded. Tensors are read
        straight into the existing tensors where possible; Stateful objects then get
        ``load_state_dict``; plain JSON values are replaced in ``state``. Keys, shapes
        and files are all checked on every rank before any byte of ``state`` changes.
        ``strict=False`` skips top-level entries and module parameters present on one
        side only. Saves still in the background are waited for first (a failure among
        them is still raised by the next `save` or `wait`). Where each rank's state
        came from is then in `last_restore`.
        """
        self._drain()
        worker.event("restore_start")
        healed = self._stepper.heal(state) if step is None else None
        if healed is None:
            healed = restoring.restore(self._restore_context(), state, step, strict)
        self.last_restore = healed
        self._stepper.agree_layouts(state, self._memory)
        restored = None if self.last_restore is None else self.last_restore.step
        worker.event("restore_done", step=restored)
        return restored

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
            records.forget(self._job)  # the job is over here: nothing left to heal
            self._worker.shutdown(wait=True)
            self._comm.close()

    def _abandon(self, timeout: float) -> bool:
        """Stop using this checkpointer without talking to the other ranks (its group
        is broken): cancel queued work and wait up to ``timeout`` for a save that is
        writing files, not for a replication (its peers are gone or aborted too).
        Whether the save stopped in time."""
        if self._closed:
            return True
        self._closed = True
        self._stepper.stop()
        with self._lock:
            running = [p._future for p in self._pending]
        self._worker.shutdown(wait=False, cancel=True)
        return not futures.wait(running, timeout).not_done

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.path!r}, rank={self.rank}/{self._comm.world_size})"
