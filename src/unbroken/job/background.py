"""Saves in the background: the handle a caller holds (`PendingSave`), the one thread
that persists saves in order, and waiting for them in a way in-process recovery can cut
short."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any, TypeVar

from unbroken.job import abort, overlap

T = TypeVar("T")


class PendingSave:
    """A save under way. ``wait()`` returns True once it is committed, False if it was
    skipped (see ``if_busy``), and raises what made it fail."""

    def __init__(self, step: int, future: Future[bool], seen: Callable[[int], None]) -> None:
        self.step = step
        self._future = future
        self._seen = seen

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        overlap.settle()  # the save waits for its copies to be settled by this thread
        try:
            if timeout is None:
                wait_for([self._future], f"waiting for the save of step {self.step}")
            return self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._seen(self.step)  # raised here: the next save() need not raise it again
            raise

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"PendingSave(step={self.step}, {state})"


class SaveThread:
    """One thread running the calls submitted to it in order, like a one-thread
    ThreadPoolExecutor but a daemon: a Checkpointer abandoned by in-process recovery may
    leave it stuck in a gloo operation until the group's timeout, which must not hold up
    the process's exit. Saves still pending at exit are waited for by the checkpointer's
    exit hook."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any], int] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="unbroken-save", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        # Bound to the generation it was submitted in: left behind by a recovery, it
        # fails at its next wait instead of waiting on the next generation's peers.
        self._queue.put((future, lambda: fn(*args), abort.generation()))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, call, generation = item
            if future.set_running_or_notify_cancel():
                try:
                    with abort.bound(generation):
                        future.set_result(call())
                except BaseException as e:
                    future.set_exception(e)

    def shutdown(self, wait: bool = True, cancel: bool = False) -> None:
        if cancel:
            with contextlib.suppress(queue.Empty):
                while (item := self._queue.get_nowait()) is not None:
                    item[0].cancel()
        self._queue.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


def wait_for(pending: list[Future[Any]], what: str) -> None:
    """Wait for ``pending`` to finish; under in-process recovery, raise as soon as the
    generation is aborted instead (see `unbroken.job.abort`)."""
    while futures.wait(pending, abort.poll_s()).not_done:
        abort.check(what)
