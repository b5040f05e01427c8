"""Waiting for changes in the coordinator's store instead of polling it; and a node
agent's signs of life to the coordinator (`beat`, `answer_pings`).

Every write that someone else must act on (an abort, a new generation, a worker's
report of a lost peer, a freed or claimed node slot, a node's ranks settled or done) is
followed by `announce`: one counter bump and one key. A `Listener` thread blocks in the
store's ``wait`` on the next announcement's key and raises a flag when it comes, so a
reader looks at the store at once after a change and otherwise only every few hundred
milliseconds (a safety net: a change nobody announced is still seen). The store's load
at idle then grows with nodes / look interval, not nodes / poll interval, while a change
still reaches every reader in one round trip (docs/scaling.md, "Finding a lost node").
The coordinator `heal`s the key of a writer lost mid-announce at each look.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from unbroken.run import contract, listen

NEWS_KEY = "unbroken/news"  # a counter; -<n>: set once the n-th change is written
HEAL_WINDOW = 64  # how many announcements back `heal` sets a missing key


def announce(store: Any) -> None:
    """Wake every listener: call after the write it must see. Never raises (a store
    that is gone is found by the caller's next request)."""
    with contextlib.suppress(Exception):
        store.set(f"{NEWS_KEY}-{int(store.add(NEWS_KEY, 1))}", "")


def heal(store: Any, since: int) -> int:
    """Set the keys of the announcements after ``since`` (the last `HEAL_WINDOW` at most)
    and return the counter. A writer lost between its bump and its key (a node killed
    mid-announce, a rank ended at the job's end) leaves a key that listeners would wait
    on for ever, missing every later change. Setting a key early is harmless: each
    writer's change is written before its bump."""
    now = int(store.add(NEWS_KEY, 0))
    keys = [f"{NEWS_KEY}-{n}" for n in range(max(since, now - HEAL_WINDOW) + 1, now + 1)]
    if keys:
        store.multi_set(keys, [""] * len(keys))
    return now


class Listener:
    """A thread on its own connection to ``host:port`` that sets `changed` at each
    announcement made after the constructor returns (a look at the store after that
    misses nothing). `take` returns and clears the flag."""

    def __init__(self, host: str, port: int) -> None:
        self.changed = threading.Event()
        self.stopped = False
        store = listen.connect(host, port)
        seen = int(store.add(NEWS_KEY, 0))
        self._thread = threading.Thread(target=self._run, args=(store, seen), name="unbroken-news")
        self._thread.start()

    def take(self) -> bool:
        if not self.changed.is_set():
            return False
        self.changed.clear()
        return True

    def stop(self, store: Any) -> None:
        """End the thread: it is woken by an announcement through ``store`` (another
        connection). It must end before the process does: a thread blocked in the
        store's C++ wait at interpreter exit aborts the process."""
        self.stopped = True
        if self._thread.is_alive():
            announce(store)
            with contextlib.suppress(Exception):
                heal(store, 0)
            self._thread.join(timeout=5.0)

    def _run(self, store: Any, seen: int) -> None:
        try:
            while not self.stopped:
                store.wait([f"{NEWS_KEY}-{seen + 1}"], timedelta(days=1))
                seen = max(seen + 1, int(store.add(NEWS_KEY, 0)))
                self.changed.set()
        except Exception:
            self.changed.set()  # the store is gone: let the reader look and find out


def beat(host: str, port: int, agent: str, stopped: threading.Event, every: float) -> None:
    """Bump ``agent``'s beat counter every ``every`` seconds, on a connection of its own,
    until ``stopped``: the coordinator's node-loss detector watches it."""
    store = listen.connect(host, port)
    while not stopped.wait(every):
        try:
            store.add(contract.agent_beat_key(agent), 1)
        except Exception:
            return  # the coordinator is gone: the agent's poll finds out
    del store


def answer_pings(
    host: str, port: int, agent: str, stopped: threading.Event, pinged: Callable[[], None]
) -> None:
    """Beat at once, then call ``pinged``, each time the coordinator pings ``agent``: it
    waits for the live agents' answers to tell a lost node from the live ones
    (`unbroken.run.coordinator`). Ends at the first ping after ``stopped``."""
    counter = f"{contract.AGENT_PREFIX}{agent}/{contract.PING_SUFFIX}"
    try:
        store = listen.connect(host, port)
        n = int(store.add(counter, 0))
        while True:
            n += 1
            store.wait([f"{counter}-{n}"], timedelta(days=1))
            if stopped.is_set():
                return
            store.add(contract.agent_beat_key(agent), 1)
            pinged()
    except Exception:
        return  # the coordinator is gone: the agent's poll finds out
