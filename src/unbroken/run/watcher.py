"""The abort watcher of an in-process rank (`unbroken.run.inprocess`): a thread on its
own store connection that waits for the supervisor to give up on the running
generation, aborts this process's groups at once, then waits for the next generation to
start, so the rank itself makes no store request while it waits."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from unbroken.job import abort
from unbroken.run import contract, worker


class AbortWatcher(threading.Thread):
    """Waits for the supervisor to give up on the running generation (it sets
    ``unbroken/abort-<g>`` as it replaces a failed rank), then aborts this process's
    groups, so that no collective of the old generation waits for its timeout."""

    def __init__(self, store: Any) -> None:
        super().__init__(name="unbroken-watcher", daemon=True)
        self.store = store
        self.generation: int | None = None
        self.done: int | None = None  # the generation aborted last
        self.begun = 0  # the newest generation whose start was announced
        self.gone: BaseException | None = None  # the store's error, once it is gone

    def watch(self, generation: int | None) -> None:
        self.generation = generation

    def fired(self, generation: int) -> bool:
        return self.done == generation

    def started(self, generation: int) -> bool:
        return self.begun >= generation

    def run(self) -> None:
        while True:
            g = self.generation
            if g is None or g == self.done:
                time.sleep(0.01)
                continue
            try:
                # Generation g ends only by this key (the supervisor sets it before it
                # starts the next one), or by training ending, when nobody cares.
                self.store.wait([f"{contract.ABORT_KEY}-{g}"], timedelta(days=1))
            except Exception as e:  # the store is gone: there is no recovery to watch for
                self.gone = e
                return
            self.done = g
            worker.event("abort", generation=g, connections=abort.shutdown(g))
            try:  # then the next one's start, which this rank waits for (`_next_generation`)
                self.store.wait([f"{contract.STARTED_KEY}-{g + 1}"], timedelta(days=1))
            except Exception as e:
                self.gone = e
                return
            self.begun = max(self.begun, g + 1)
