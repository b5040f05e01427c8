# mypy: disallow-untyped-defs
"""The scale harness's recovery protocol (bench/scale.py): a node lost at ``n`` ranks,
from the first worker's report to every rank in the next generation, on a real
`TCPStore` (`unbroken.run.listen.store`) and a real `Coordinator`.

What runs, one thread per party, every party on connections of its own, as on a cluster;
the store and the coordinator in this process, the nodes' agents and ranks in host
processes of 16 nodes each (bench/scale_hosts.py):

- the coordinator: `unbroken.run.coordinator.Coordinator` with its `Listener`, polled
  every `coordinator.POLL_S` as `coordinator.serve` does;
- ``n / 8`` node agents: `unbroken.run.agent.NodeAgent`'s own code (`start`: joining
  the job, claiming a slot, the news listener, the beat and ping-answer threads; `poll`:
  following generations, handling aborts, settling) in `SimAgent`, which spawns threads
  instead of worker processes and has no heartbeat watch (no worker writes heartbeats);
  each is driven as `unbroken.run.cli.loop` drives it. A replacement agent started with
  ``--node-rank`` of the lost node waits to claim its slot;
- ``n`` ranks: each the store traffic `unbroken.run.in_process` makes around a failure,
  with its functions: `_generation` at start, the `AbortWatcher`'s two waits (the abort
  key, then the next generation's started key; on the rank's thread here, where the
  watcher has one of its own), `_next_generation` (one read once the next generation
  started); the lost node's two ring neighbours `_report` it.

What is simulated: the node loss (its agent stops beating and answering, its ranks make
no request), and training (none: a rank waits for the abort from the moment it starts).
The coordinator runs with a node timeout of 600 s, so the node is found by the
report-and-ping path (`--suspect-timeout`, 0.2 s), not by the timeout (2 s by default).
Every store request is counted (`Counted`, installed as ``torch.distributed.TCPStore``
while this runs, so connections the agents' and listeners' threads open themselves are
counted too), with its time and its party; phases are cut at:

- detection: the first report -> the coordinator sets ``unbroken/abort-0``;
- abort: -> every healthy rank's watcher woke and every live agent settled;
- generation start: -> every healthy rank saw generation 1 and every replacement rank
  started (read the generation).

On this 2-core machine the parties share the CPUs that a cluster gives each node: times
are upper bounds, store requests are exact.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

import scale_hosts
from scale_hosts import LOCAL
from unbroken.run import cli, contract, coordinator, inprocess, listen, silence, watcher
from unbroken.run.agent import NodeAgent
from unbroken.run.listen import LOOPBACK
from unbroken.run.news import Listener
from unbroken.run.timeline import Timeline

# torch formats each new connection's addresses with a reverse lookup, which in this
# sandbox goes to an unreachable DNS server for 5 s every ~50 connections: 1 s, once.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
LOST_NODE = 1
PHASES = ("detection", "abort", "generation start")
IDLE_S = 0.5  # of idle before the failure, to measure the store's load at rest
DEADLINE_S = float(os.environ.get("SCALE_DEADLINE_S", 300))
_RealStore = dist.TCPStore
_party = threading.local()


@dataclass
class Log:
    """Every counted request: (start, end, party, method, key)."""

    requests: list[tuple[float, float, str, str, str]] = field(default_factory=list)

    def marks(self, method: str, key: str) -> list[float]:
        return [end for _, end, _, m, k in self.requests if m == method and k == key]


class Counted:
    """A store connection whose every request is logged (Python calls)."""

    def __init__(self, store: Any, party: str, log: Log) -> None:
        self._store, self.party, self._log = store, party, log

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)
        if not callable(call):
            return call

        def counted(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return call(*args, **kwargs)
            finally:
                key = args[0] if args and isinstance(args[0], str) else ""
                if args and isinstance(args[0], list) and args[0]:
                    key = str(args[0][0])
                self._log.requests.append((start, time.monotonic(), self.party, name, key))

        return counted


@contextlib.contextmanager
def counting(log: Log, default: str) -> Iterator[None]:
    """Client connections opened meanwhile (``dist.TCPStore(..., is_master=False)``) are
    `Counted`, for the party of the thread that opens them (the agents' own threads by
    their names)."""

    def connect(*args: Any, **kwargs: Any) -> Any:
        store = _RealStore(*args, **kwargs)
        party = getattr(_party, "name", None)
        if party is None:  # a thread the party's own code started (its name: unbroken-*)
            name = threading.current_thread().name
            party = default if name.startswith("unbroken") else f"? {name}"
        return Counted(store, party, log)

    dist.TCPStore = connect  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        dist.TCPStore = _RealStore  # type: ignore[misc]


def as_party(name: str, fn: Callable[..., None], *args: Any) -> threading.Thread:
    def run() -> None:
        _party.name = name
        fn(*args)

    return threading.Thread(target=run, daemon=True)


class Sim:
    """What the simulated job's threads report: when each rank woke, settled, started."""

    def __init__(self, world: int, port: int) -> None:
        self.world, self.port = world, port
        self.stop = threading.Event()
        self.ready = 0  # ranks waiting on the abort key
        self.woke: dict[int, float] = {}
        self.moved: dict[int, float] = {}  # healthy ranks: saw the next generation
        self.started: dict[int, float] = {}  # replacement ranks
        self.settled: dict[str, float] = {}
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def spawn(self, rank: int, generation: int) -> None:
        t = as_party("ranks", self.rank, rank, generation)
        self.threads.append(t)
        t.start()

    def rank(self, rank: int, generation: int) -> None:
        try:
            store = inprocess._connect(60.0)
            g = inprocess._generation(store)
            if generation:
                self.started[rank] = time.monotonic()
                return
            self.ready += 1
            store.wait([f"{contract.ABORT_KEY}-{g}"], timedelta(seconds=DEADLINE_S))
            if rank // LOCAL == LOST_NODE:
                return  # its process is gone
            self.woke[rank] = time.monotonic()
            store.wait([f"{contract.STARTED_KEY}-{g + 1}"], timedelta(seconds=DEADLINE_S))
            seen = _Followed(store, g)
            inprocess._next_generation(store, g, DEADLINE_S, "a peer was lost", "scale", seen)
            self.moved[rank] = time.monotonic()
        except Exception as e:
            self.errors.append(f"rank {rank}: {e}")


class _Followed(watcher.AbortWatcher):
    """What a rank's watcher knows once generation ``g`` was aborted and ``g + 1``
    started (the two waits its thread makes, made on the rank's thread): never started."""

    def __init__(self, store: Any, g: int) -> None:
        super().__init__(store)
        self.done, self.begun = g, g + 1


class _Quiet(Timeline):
    """The agent's timeline, kept but not printed: 288 agents would print every event."""

    def record(self, event: str, message: str | None, t: float, **kw: Any) -> None:
        self.events.append({"event": event, "t": round(t - self.t0, 4), **kw})


class SimAgent(NodeAgent):
    """A `NodeAgent` whose ranks are `Sim` threads: no processes, heartbeat files or
    watch, so `Supervisor.__init__` is not run; every store-facing method is the agent's."""

    def __init__(self, sim: Sim, node_rank: int | None) -> None:
        self.sim = sim
        ours = SimpleNamespace(warm_spare=False, secret_file=None)
        self.opts = SimpleNamespace(max_restarts=100, ours=ours)  # type: ignore[assignment]
        self.local, self.nodes, self.world = LOCAL, sim.world // LOCAL, sim.world
        self.host, self.port, self.relay, self.wanted = LOOPBACK, sim.port, None, node_rank
        self.slot, self.id, self.generation, self.seen_abort = -1, uuid.uuid4().hex[:12], -1, -1
        self.generation_t, self.dead, self.memory_dir = 0.0, set(), ""
        self.stopped, self.beater, self.answerer = threading.Event(), None, None
        self.fast_until, self.news, self.looked = 0.0, None, -math.inf
        self.stopping, self.probing, self.workers, self.spares = False, None, {}, None
        self.timeout = 60.0  # printed only: no heartbeat watch
        self.killed = threading.Event()  # its machine is gone
        self.timeline = _Quiet(mode="in-process")

    def spawn(self, rank: int, generation: int) -> None:
        self.sim.spawn(rank, generation)

    def check_workers(self) -> None:
        pass

    def give_up(self, why: str) -> None:
        self.sim.errors.append(f"agent {self.slot}: {why}")
        self.stopping = True

    def _settle(self) -> None:
        super()._settle()
        self.sim.settled[self.id] = time.monotonic()

    def drive(self) -> None:
        """`unbroken.run.cli.loop`'s polling, until the harness stops or the node dies."""
        try:
            self._drive()
        except Exception as e:
            self.sim.errors.append(f"agent {self.slot}: {e!r}")

    def _drive(self) -> None:
        self.start()
        while not self.sim.stop.is_set() and not self.killed.is_set():
            if not self.poll():
                break
            self.pause(cli.POLL_S)
        self._stop_beating()


def host(conn: Connection, index: int, world: int, port: int, nodes: list[int],
         replacement: bool) -> None:  # fmt: skip
    """One host process (bench/scale_hosts.py): the agents of ``nodes`` and their ranks,
    plus the lost node's replacement agent if ``replacement``, until told to stop; then
    what its parties did."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)
    log, sim = Log(), Sim(world, port)
    with counting(log, "agents"):
        agents = {n: SimAgent(sim, n) for n in nodes}
        spare = SimAgent(sim, LOST_NODE) if replacement else None
        drivers = [as_party("agents", a.drive) for a in agents.values()]
        for t in drivers:
            t.start()
        ours = scale_hosts.ranks(nodes)
        healthy = len([r for r in ours if r // LOCAL != LOST_NODE])
        _until(lambda: sim.ready == len(ours), sim)
        conn.send(("ready", index))
        told, done = "", False
        while told != "stop":
            if sim.errors:
                conn.send(("error", sim.errors[:3]))
                return
            if conn.poll(0.01):
                told = conn.recv()
                if told == "replace" and spare is not None:
                    drivers.append(as_party("agents", spare.drive))
                    drivers[-1].start()
                elif told == "kill":
                    agents[LOST_NODE].killed.set()
                    agents[LOST_NODE].stopped.set()  # beats no more, answers no ping
                    conn.send(("killed", index))
            if (
                not done
                and len(sim.moved) == healthy
                and len(sim.started) == (LOCAL if spare else 0)
            ):
                conn.send(("done", index))
                done = True
        sim.stop.set()
        for t in drivers + sim.threads:
            t.join(timeout=30)
    live = [a.id for a in agents.values() if a.slot != LOST_NODE]
    conn.send(("result", (log.requests, sim.woke, sim.moved, sim.started, sim.settled, live)))


def _until(done: Callable[[], bool], sim: Sim) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if sim.errors or time.monotonic() > deadline:
            counts = f"{sim.ready} ready, {len(sim.woke)} woke, {len(sim.moved)} moved"
            raise RuntimeError(f"starting: {sim.errors[:3] or 'timed out'} ({counts})")
        time.sleep(0.01)


def run(world: int) -> dict[str, Any]:
    """One node loss at ``world`` ranks: per phase, seconds and requests by party."""
    os.environ.pop("UNBROKEN_JOB_SECRET", None)  # no gate: agents reach the store directly
    log = Log()
    raw = listen.store()
    raw.add(contract.GENERATION_KEY, 0)
    groups = scale_hosts.split(world)
    last = len(groups) - 1  # the replacement's host; the lost node is in host 0's
    with counting(log, "coordinator"):
        _party.name = "coordinator"
        # Thousands of agents share 2 cores here: a beat can stall for seconds, which the
        # silence rule would take for a stopped machine. Detection here is by report.
        quiet = silence.Silence(ping_after_s=600.0)
        coord = coordinator.Coordinator(
            _RealStore("127.0.0.1", raw.port, is_master=False), 600.0, silence=quiet
        )
        coord.store = Counted(coord.store, "coordinator", log)
        coord.news = Listener(LOOPBACK, raw.port)
        poll = _paced(coord.poll)  # as `coordinator.serve` polls: every POLL_S
        hosts = scale_hosts.Hosts(
            host, len(groups), lambda i: (world, raw.port, groups[i], i == last)
        )
        try:
            hosts.gather("ready", poll)
            hosts.send(last, "replace")  # it waits for the lost node's slot
            _idle(IDLE_S, poll)
            hosts.send(0, "kill")
            hosts.gather("killed", poll, only=[0])
            reporter = Counted(_RealStore("127.0.0.1", raw.port, is_master=False), "ranks", log)
            t0 = time.monotonic()
            for rank in (LOST_NODE * LOCAL - 1, (LOST_NODE + 1) * LOCAL % world):
                inprocess._report(reporter, 0, rank)
            hosts.gather("done", poll)
            for i in range(len(groups)):
                hosts.send(i, "stop")
            results = hosts.gather("result")
        finally:
            hosts.close()
        coord.news.stop(raw)
    woke, moved, started, settled, live = _merge(log, results)
    detect = min(log.marks("compare_set", f"{contract.ABORT_KEY}-0"))
    healthy = [r for r in range(world) if r // LOCAL != LOST_NODE]
    aborted = max([woke[r] for r in healthy] + [settled[a] for a in live])
    out = _phases(log, [t0, detect, aborted, max([*moved.values(), *started.values()])], t0)
    out["abort"]["last_rank_woke_s"] = max(woke[r] for r in healthy) - detect
    out["abort"]["last_agent_settled_s"] = max(settled[a] for a in live) - detect
    out["threads"] = world + 4 * (world // LOCAL + 1)
    out["hosts"] = len(groups)
    return out


def _merge(log: Log, results: list[Any]) -> list[Any]:
    """The hosts' requests into ``log``; their parties' marks joined."""
    merged: list[Any] = [{}, {}, {}, {}, []]
    for requests, *marks in results:
        log.requests.extend(requests)
        for into, mark in zip(merged, marks, strict=True):
            into.update(mark) if isinstance(into, dict) else into.extend(mark)
    return merged


def _paced(poll: Callable[[], object]) -> Callable[[], None]:
    last = -math.inf

    def paced() -> None:
        nonlocal last
        if time.monotonic() - last >= coordinator.POLL_S:
            poll()
            last = time.monotonic()

    return paced


def _idle(seconds: float, poll: Callable[[], object]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        poll()
        time.sleep(0.01)


def _phases(log: Log, bounds: list[float], t0: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (a, b) in zip(PHASES, itertools.pairwise(bounds), strict=True):
        parties: dict[str, int] = {}
        for start, _, party, _, _ in log.requests:
            if a <= start < b:
                parties[party] = parties.get(party, 0) + 1
        out[name] = {"s": b - a, "requests": sum(parties.values()), "by_party": parties}
    idle = [p for s, _, p, _, _ in log.requests if t0 - IDLE_S <= s < t0]
    out["idle_requests_per_s"] = len(idle) / IDLE_S
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(run(int(sys.argv[1])), indent=1))
