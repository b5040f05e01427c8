# mypy: disallow-untyped-defs
"""The scale harness's simulated hosts (bench/scale_protocol.py, bench/scale_groups.py):
the job's parties spread over processes, ``HOST_RANKS`` ranks (and their nodes' agents)
per process, the coordinator and the store in the harness's own.

One process held every thread before: at 2,304 ranks some 2,900 threads took turns on one
interpreter lock, and the kernel's time handing it over (more system than user CPU)
was most of what the harness measured: a coordinator's single request waited a second
for the lock. A cluster gives each node its own cores and interpreters; here each group
of nodes gets its own interpreter, and the processes share the 2 cores. Times stay upper
bounds (every party still shares this machine's 2 cores); what no longer counts is
one lock for every thread of the job. Each process is forked from a server that
imported torch and the harness once (multiprocessing's ``forkserver``, with its
preload), and talks to the harness over a pipe: a host reports when its parties
reached a point (``ready``, ``done``), the harness orders it on (``replace``, ``kill``,
``go``, ``stop``). All parties read ``time.monotonic`` (one clock for every process),
so the phases are cut as before.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

LOCAL = 8  # ranks per node, in every part of the harness
HOST_RANKS = 128  # 16 nodes of 8 per process: 18 processes at 2,304 ranks, 32 at 4,096
DEADLINE_S = 300.0
CLOSE_S = 30.0
SWITCH_S = 0.05  # the host processes' interpreter switch interval (_serve)


def split(world: int) -> list[list[int]]:
    """The node ranks each host process holds."""
    per = max(1, HOST_RANKS // LOCAL)
    nodes = list(range(world // LOCAL))
    return [nodes[i : i + per] for i in range(0, len(nodes), per)]


def ranks(nodes: list[int]) -> list[int]:
    """The ranks of ``nodes``."""
    return [r for n in nodes for r in range(n * LOCAL, (n + 1) * LOCAL)]


def _serve(where: tuple[str, str], conn: Connection, index: int, *args: Any) -> None:
    """A host process: ``where``'s function; an exception goes back as its error."""
    # A thread waiting for the interpreter lock wakes every switch interval to ask for
    # it: at the default 5 ms, 128 ranks woken at once (an abort, a new generation) kept
    # the kernel so busy that the store's thread, in the harness's process, answered in
    # seconds. These threads wait on sockets; none needs the lock handed over sooner.
    sys.setswitchinterval(SWITCH_S)
    module, name = where
    try:
        getattr(importlib.import_module(module), name)(conn, index, *args)
    except Exception as e:
        conn.send(("error", f"host {index}: {e!r}"))


class Hosts:
    """The host processes of one run, from the harness's side: ``target(conn, index,
    *args)`` runs in each, ``args`` per host from ``args_of(index)``."""

    def __init__(self, target: Callable[..., None], count: int,
                 args_of: Callable[[int], tuple[Any, ...]]) -> None:  # fmt: skip
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([target.__module__])
        where = (target.__module__, target.__qualname__)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(count):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(where, theirs, i, *args_of(i)), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def send(self, index: int, message: Any) -> None:
        self.conns[index].send(message)

    def gather(self, kind: str, between: Callable[[], object] = lambda: None,
               only: list[int] | None = None) -> list[Any]:  # fmt: skip
        """Each host's (or ``only`` those) next message, which must be ``(kind, payload)``:
        the payloads in host order. ``between`` runs every few milliseconds meanwhile (the
        coordinator's poll). A host's ``("error", why)`` or its death raises."""
        wanted = list(range(len(self.conns))) if only is None else only
        got: dict[int, Any] = {}
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < len(wanted):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind}: {len(got)} of {len(wanted)} hosts in {DEADLINE_S} s")
            waiting = {self.conns[i]: i for i in wanted if i not in got}
            for conn in wait(list(waiting), timeout=0.01):
                i = waiting[conn]  # type: ignore[index]
                try:
                    what, payload = self.conns[i].recv()
                except EOFError:
                    raise RuntimeError(f"{kind}: host {i} exited") from None
                if what != kind:
                    raise RuntimeError(f"{kind}: host {i} sent {what}: {payload}")
                got[i] = payload
            between()
        return [got[i] for i in wanted]

    def close(self) -> None:
        """Every host gone: ``CLOSE_S`` for all to exit, then killed."""
        deadline = time.monotonic() + CLOSE_S
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
        for conn in self.conns:
            conn.close()
