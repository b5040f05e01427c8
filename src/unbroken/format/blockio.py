"""The lowest layer of moving block bytes: a tensor's bytes as a buffer, reading a byte
range of a shard file into one with errors that name the tensor, and checking a block
against its manifest checksum. Shared by `unbroken.format.shards` and `unbroken.format.coalesce`."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any, TypeVar

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.layout import Chunk, verify_block
from unbroken.storage import Storage

T = TypeVar("T")
Item = TypeVar("Item")


def read_into(
    storage: Storage, folder: str, key: str, file: str, start: int, out: memoryview
) -> None:
    with _reading(folder, key, file, start, start + len(out)):
        storage.read_into(f"{folder}/{file}", start, out)


def read_scatter(
    storage: Storage, folder: str, key: str, file: str, parts: Sequence[tuple[int, memoryview]]
) -> None:
    """Fill each ``(start, out)`` of ``parts`` with ``file``'s bytes from ``start``, in one
    request where the storage can (``read_scatter``: a ranged GET copied straight into
    every destination), else (or for one part) one `read_into` per part."""
    scatter = getattr(storage, "read_scatter", None)
    if scatter is None or len(parts) == 1:
        for start, out in parts:
            read_into(storage, folder, key, file, start, out)
        return
    end = max(start + len(out) for start, out in parts)
    with _reading(folder, key, file, min(start for start, _ in parts), end):
        scatter(f"{folder}/{file}", parts)


def read_range(
    storage: Storage, folder: str, key: str, file: str, start: int, length: int
) -> memoryview:
    """Bytes [start, start + length) of ``file``, as the storage received them: only for a
    storage with ``read_range`` (see `unbroken.storage.Storage`)."""
    with _reading(folder, key, file, start, start + length):
        return storage.read_range(f"{folder}/{file}", start, length)  # type: ignore[attr-defined]


@contextlib.contextmanager
def _reading(folder: str, key: str, file: str, start: int, end: int) -> Iterator[None]:
    """Errors of a read of bytes [start, end) of ``file``, for tensor ``key``, that say
    what happened in the checkpoint's terms."""
    try:
        yield
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder}/{file} disappeared while tensor {key!r} was being read from it: "
            "something removed it during the restore"
        ) from None
    except EOFError:
        raise CorruptCheckpointError(
            f"{folder}: {file} is truncated; tensor {key!r} (bytes {start}-{end}) is "
            "missing. Restore an earlier step (see `unbroken ls`)."
        ) from None


def verify_chunk(
    folder: str, key: str, chunk: Chunk, view: memoryview | Sequence[memoryview]
) -> None:
    verify_block(
        view,
        chunk.xxh3,
        f"{folder}: tensor {key!r} in {chunk.file} (bytes {chunk.start}-{chunk.end})",
        "; the file is damaged. Restore an earlier step (see `unbroken ls`).",
    )


# -- workers ---------------------------------------------------------------------------
#
# Reads run on daemon threads kept for the life of the process: starting 16 threads for
# every restore costs tens of ms on a busy machine (each start waits for the new thread
# to run), and a hung request must not hold up the process's exit.


class _Workers:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]]
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._busy = 0

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on a thread of its own: there is always an idle one for it, so a
        call waiting on another never waits for a thread."""
        with self._lock:
            self._busy += 1
            if self._busy > self._threads:
                self._threads += 1
                threading.Thread(target=self._run, name="unbroken-io", daemon=True).start()
        future: Future[T] = Future()
        self._queue.put((future, fn))
        return future

    def _run(self) -> None:
        while True:
            future, fn = self._queue.get()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:
                        future.set_exception(e)
            finally:
                with self._lock:
                    self._busy -= 1
                # An idle worker must not keep its last call alive: it may hold every
                # buffer a restore read (see shards.read_held).
                del future, fn


_workers = _Workers()


def _reset() -> None:  # a forked child has none of its parent's threads
    global _workers
    _workers = _Workers()


os.register_at_fork(after_in_child=_reset)


def start(fn: Callable[[], T]) -> Future[T]:
    """Run ``fn`` on an IO worker now: a request that need not hold up the caller."""
    return _workers.submit(fn)


def run_all(fn: Callable[[Item], object], items: Sequence[Item], threads: int) -> None:
    """Call ``fn`` on every item, ``threads`` at a time (on the process's IO workers);
    return once every call has returned, raising the first error (no new calls start
    after one)."""
    if threads <= 1 or len(items) <= 1:
        for item in items:
            fn(item)
        return
    it = iter(items)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def drain() -> None:
        while True:
            with lock:
                item = next(it, _END) if not errors else _END
            if item is _END:
                return
            try:
                fn(item)  # type: ignore[arg-type]
            except BaseException as e:
                with lock:
                    errors.append(e)

    pending = [_workers.submit(drain) for _ in range(min(threads, len(items)))]
    futures.wait(pending)
    if errors:
        raise errors[0]


_END = object()
