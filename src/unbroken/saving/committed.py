"""Rank 0's view of the committed steps, kept in memory, and the background thread that
deletes what retention lets go.

Saves never list the directory (a LIST and a HEAD per step on object stores, growing
with the number of checkpoints), but for one listing at the Checkpointer's first save,
run on this thread (a Checkpointer that only restores never lists); from then on every
commit and deletion of this job updates the index. The same first pass removes the
leftovers of saves that crashed before (step folders without a manifest); a save of this
job that fails removes its own folder (see `saving.persist`).

What holds: within a job, retention never deletes the newest committed step, nor a step
a restore is reading (`Checkpointer.restore` waits for deletions in flight and pauses
retention until it is done). Across jobs nothing is locked: this index knows the steps committed
by this job and those listed at open, and deletes only among them, so the newest step of
another job writing the same path meanwhile is never touched by retention; but a reader in
another job may lose an older step it is reading (its restore then falls back or fails
cleanly, see `unbroken.restoring.pipeline`). One job writes a path at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import INFO, step_dir
from unbroken.format.validate import info_fields
from unbroken.restoring.sources import StorageSource
from unbroken.retention import Info, KeepAny, KeepBest, KeepPerWindow, Retention, doomed
from unbroken.run import faults
from unbroken.saving import claims

log = logging.getLogger("unbroken")


class Collector:
    """The index of committed steps and the deleting thread, on rank 0 (``active``);
    on other ranks every method is a cheap no-op."""

    def __init__(self, directory: Directory, rule: Retention | None, active: bool) -> None:
        self.directory, self.rule = directory, rule
        self._lock = threading.Lock()
        self._known: dict[int, Info] = {}
        self._paused = 0
        self._damaged: set[int] = set()  # found damaged: never counted as the newest good
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="unbroken-gc") if active else None
        self._opened: Future[Any] | None = None
        self._last: Future[Any] | None = None

    def _ensure_open(self) -> Future[Any] | None:
        with self._lock:
            if self._opened is None and self._thread is not None:
                self._opened = self._last = self._thread.submit(self._open)
            return self._opened

    def _open(self) -> None:
        """The one listing: known steps, and the leftovers of earlier crashed saves."""
        for name in self.directory.leftovers():
            if (claim := claims.read(self.directory.storage, name)) and claim.live(None):
                log.warning("%s: not removing %s: %s may be saving it", self.directory, name, claim)
                continue
            log.info("%s: removing %s, left by a save that did not commit", self.directory, name)
            faults.point("leftover-clear")
            self.directory.storage.delete(name)
        steps = self.directory.steps()
        infos = {s: Info(s) for s in steps}
        if _needs_info(self.rule):
            infos = {s: read_info(self.directory, s) for s in steps}
        with self._lock:
            self._known = {**infos, **self._known}

    def known(self) -> list[int]:
        """Committed steps this job knows of, oldest first (the first call lists)."""
        opened = self._ensure_open()
        if opened is not None:
            opened.result()
        with self._lock:
            return sorted(self._known)

    def committed(self, info: Info) -> None:
        """``info.step`` is committed: note it, and apply retention in the background."""
        if self._thread is None or self._ensure_open() is None:
            return
        with self._lock:
            self._known[info.step] = info
        if self.rule is not None:
            self._last = self._thread.submit(self._collect)

    def damaged(self, step: int) -> None:
        """A restore found ``step`` damaged: retention keeps the newest step that is not."""
        with self._lock:
            self._damaged.add(step)

    def collect(self) -> list[int]:
        """Apply retention now, on the collector's thread, as a commit does; the steps it
        deleted."""
        if self._thread is None or self._ensure_open() is None:
            return []
        future = self._thread.submit(self._collect)
        self._last = future
        return future.result()

    def forget(self, step: int) -> None:
        """``step`` was deleted by someone else than this thread (a rollback)."""
        with self._lock:
            self._known.pop(step, None)

    def _collect(self) -> list[int]:
        """Delete what retention lets go of the steps not known damaged (see `let_go`)."""
        with self._lock:
            infos = [i for s, i in sorted(self._known.items()) if s not in self._damaged]
        deleted = []
        for step in let_go(self.directory, self.rule, infos, self.damaged):
            with self._lock:
                if self._paused:
                    break  # a restore is reading: tried again after the next save
            log.info("%s: retention deletes step %d", self.directory, step)
            self.directory.delete(step)
            self.forget(step)
            deleted.append(step)
        return deleted

    def wait(self) -> None:
        """Until the deletions asked for so far are done (errors are logged, not raised:
        a step that could not be deleted is tried again after the next save)."""
        if self._last is None:
            return
        try:
            self._last.result()
        except Exception as e:
            log.warning("%s: deleting old checkpoints failed: %s", self.directory, e)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No deletion while in the block (a restore reading), none in flight on entry."""
        with self._lock:
            self._paused += 1
        self.wait()
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    def close(self) -> None:
        self.wait()
        if self._thread is not None:
            self._thread.shutdown(wait=True)


def let_go(
    directory: Directory,
    rule: Retention | None,
    infos: Sequence[Info],
    damaged: Callable[[int], None] = lambda step: None,
) -> list[int]:
    """The steps of ``infos`` (committed, oldest first) that ``rule`` lets go, once the
    newest of them, the one the others are deleted for, is whole: its manifest, and every
    file at its size (a request per file of one step, never a listing). A newest step that
    is not is kept, no longer counted (``damaged`` is told), and the next newest checked in
    its place: what is left can always be restored. What ``keep=`` and ``unbroken gc`` do."""
    infos = list(infos)
    while (victims := doomed(rule, infos)) and not whole(directory, infos[-1].step):
        damaged(infos.pop().step)
    return victims


def whole(directory: Directory, step: int) -> bool:
    """Whether committed ``step`` is whole (see `let_go`); the damage found is logged."""
    source = StorageSource(directory, step)
    try:
        manifest = source.open()
        source.check(manifest, set(manifest.files))
        return True
    except CheckpointError as e:
        log.error("%s: step %d is damaged (%s); retention keeps older steps", directory, step, e)
        return False


def read_info(directory: Directory, step: int) -> Info:
    """What retention knows of a committed ``step``: its info file, or its manifest's
    time for a step saved before there were info files."""
    try:
        return Info(step, *info_fields(directory.storage.read(f"{step_dir(step)}/{INFO}")))
    except (FileNotFoundError, CorruptCheckpointError, ValueError, KeyError, TypeError):
        return Info(step, directory.manifest(step).created)


def _needs_info(rule: Retention | None) -> bool:
    if isinstance(rule, KeepAny):
        return any(_needs_info(r) for r in rule.rules)
    return isinstance(rule, KeepPerWindow | KeepBest)
