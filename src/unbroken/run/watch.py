"""The launcher's eyes on its workers, shared by both launch modes: the heartbeat
watchdog, the workers' timeline events, and their requests to kill a simulated node, all
read from the heartbeat directory (file names: `unbroken.run.contract`).

`Watch` only observes and reports; what to do about a hang or a node-kill request is the
launch mode's call, through the small `WatchHooks` it is given (composition: the
restart-all launcher and the in-process supervisor each hand it their own).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, NamedTuple, Protocol

from unbroken.access import Access
from unbroken.run import contract, reached
from unbroken.run.pace import Pace
from unbroken.run.procs import alive, cpu_ticks, rank_of, stopped, trees
from unbroken.run.timeline import Timeline

CLOSE_GRACE = 10  # heartbeat timeouts a process may take to shut down after closing
BUSY_S = 1.0  # a spare taken while importing is hung once its CPU time stood still this long
STOPPED_EVERY_S = 1.0  # how often the workers' process trees are read for stopped ones


class Stale(NamedTuple):
    """A rank past the heartbeat timeout: its last step and beat (wall clock)."""

    step: int
    beat: float
    rank: int
    pid: int


class Beat(NamedTuple):
    step: int
    t: float  # wall clock
    pid: int
    attempt: int


class WatchHooks(Protocol):
    def since(self, beat: float, attempt: int) -> float:
        """When a rank whose last heartbeat was at ``beat`` (wall clock) in ``attempt``
        last showed it was making progress."""
        ...

    def on_hang(self, stale: list[Stale], now: float) -> None:
        """Ranks are past the heartbeat timeout (at most once per timeout)."""
        ...

    def kill_node(self, node: int) -> None:
        """A worker asked for simulated node ``node`` to die (a kill-node fault)."""
        ...

    def live_pids(self) -> list[int]:
        """The processes the launch started that still run: the workers are among them
        or below them."""
        ...


class Watch:
    """Polls ``directory`` for ``hooks``, recording what it sees in ``timeline``;
    ``pace``: each rank's hang limit (its ceiling, the heartbeat timeout in seconds;
    0: no watchdog)."""

    def __init__(self, directory: str, timeline: Timeline, pace: Pace, hooks: WatchHooks) -> None:
        self.dir = directory
        self.timeline = timeline
        self.pace = pace
        self.timeout = pace.ceiling
        self.hooks = hooks
        self.beats: dict[int, Beat] = {}  # by rank
        self.seen_exit: set[int] = set()  # pids whose exit is on the timeline
        self.ignored: set[int] = set()  # pids killed, or done training: never stale
        self.finished: dict[int, int] = {}  # pid -> rank: train() returned, exiting
        self.closing: dict[int, float] = {}  # pid -> when its Checkpointer closed
        self.importing: dict[int, tuple[float, int, float]] = {}  # see `expect`, `_busy`
        self.halted: dict[int, tuple[int, float]] = {}  # pid -> rank, first seen stopped
        self.looked = float("-inf")  # when the process trees were last read (`check_stopped`)
        self.last_kill = float("-inf")  # monotonic
        self.offsets: dict[str, int] = {}  # events file -> bytes read
        timeline.log = os.path.join(directory, contract.LAUNCHER_EVENTS)

    def poll(self) -> None:
        """One look at everything: events first, then node-kill requests, heartbeats."""
        self.read_events()
        self.handle_node_requests()
        self.check_heartbeats()
        self.check_stopped()

    def ignore(self, pid: int) -> None:
        """Never judge ``pid`` hung (killed already, or done training)."""
        self.ignored.add(pid)

    def hold_off(self) -> None:
        """A rank was just killed: judge the others only a heartbeat timeout from now."""
        self.last_kill = time.monotonic()

    def saw_exit(self, pid: int) -> bool:
        """Note that ``pid`` exited; False if that was known already."""
        if pid in self.seen_exit:
            return False
        self.seen_exit.add(pid)
        return True

    # -- events the workers write

    def read_events(self) -> None:
        for name in sorted(os.listdir(self.dir)):
            if not name.startswith(contract.EVENTS_PREFIX):
                continue
            path = os.path.join(self.dir, name)
            with open(path, "rb") as f:
                f.seek(self.offsets.get(name, 0))
                data = f.read()
            whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            self.offsets[name] = self.offsets.get(name, 0) + len(whole)
            for line in whole.splitlines():
                self._record(json.loads(line))

    def _record(self, e: dict[str, Any]) -> None:
        name, t = e.pop("event"), e.pop("t")
        if name == "steps":  # step spans: for `unbroken goodput`; the timeline keeps the last
            step, _, end = e["spans"][-1]
            self.timeline.last_step[e["pid"]] = (step, end)
            return
        if e.get("process_start") is not None:  # like every time: since launch
            e["process_start"] = round(e["process_start"] - self.timeline.t0, 4)
        message = None
        if name == "fault":
            message = f"fault injected: {e['spec']} (rank {e['rank']} at step {e['step']})"
        if name == "closing":  # judged again only once it ticks after this
            self.closing[e["pid"]] = t
        if name == "train_done":
            # A rank whose train() returned ticks no more: the watchdog leaves it alone.
            self.finished[e["pid"]] = e["rank"]
            self.ignore(e["pid"])
        self.timeline.record(name, message, t, **e)

    # -- kill-node requests

    def handle_node_requests(self) -> None:
        for name in os.listdir(self.dir):
            if not name.startswith(contract.KILL_NODE_PREFIX):
                continue
            node = int(name.rsplit("-", 1)[1])
            os.unlink(os.path.join(self.dir, name))
            self.hooks.kill_node(node)

    # -- heartbeats: worker exits and hangs

    def check_heartbeats(self) -> None:
        now = time.time()
        self._read_beats()
        stale = []
        for rank, (step, t, pid, attempt) in sorted(self.beats.items()):
            if pid in self.seen_exit:
                continue
            if not alive(pid):
                self.seen_exit.add(pid)
                step = self._last_step(pid, step)
                self.timeline.add(
                    "worker_exit",
                    f"rank {rank} (pid {pid}, attempt {attempt}) exited after step {step}",
                    rank=rank,
                    pid=pid,
                    step=step,
                    attempt=attempt,
                    silent_s=round(now - t, 3),  # since its last heartbeat
                )
            elif (
                self.timeout
                and now - self.hooks.since(t, attempt) > self.pace.limit(rank)
                and pid not in self.ignored
                and not self.shutting_down(pid, t, now)
                and not self._busy(pid, t, now)
            ):
                stale.append(Stale(step, t, rank, pid))
        self._hung(stale, now)

    def _hung(self, stale: list[Stale], now: float) -> None:
        """Report ``stale`` ranks, unless a kill came within the last timeout (its
        recovery is still under way)."""
        if stale and time.monotonic() - self.last_kill > self.timeout:
            self.hooks.on_hang(stale, now)

    def check_stopped(self) -> None:
        """A worker stopped (SIGSTOP, a tracer) past its hang limit is hung, beat or no
        beat: one stopped while it starts has no beat to be judged by until
        `contract.FIRST_STEP_S` has passed, and torchrun's shutdown would wait 30 s for it
        to act on its SIGTERM. Stopped is not waiting: a rank waiting for its peers sleeps,
        and is never judged here."""
        now = time.time()
        if not self.timeout or now - self.looked < STOPPED_EVERY_S:
            return
        self.looked = now
        ranks = {beat.pid: rank for rank, beat in self.beats.items()}
        halted = {}
        for pid in trees(self.hooks.live_pids()):  # one read of /proc for them all
            if pid in self.ignored or not stopped(pid):
                continue
            rank = ranks[pid] if pid in ranks else rank_of(pid)
            if rank is not None:  # a worker, not an agent or a template
                halted[pid] = (rank, self.halted.get(pid, (rank, now))[1])
        self.halted = halted
        stale = [
            Stale(self.beats[rank].step if rank in self.beats else -1, since, rank, pid)
            for pid, (rank, since) in halted.items()
            if now - since > self.pace.limit(rank)
        ]
        self._hung(stale, now)

    def expect(
        self, rank: int, pid: int, attempt: int, grace: float = 0.0, importing: bool = False
    ) -> None:
        """Beat once for ``rank``'s new process ``pid``: one that stops before its own
        first beat (a spare stopped as it was assigned) is judged hung like any other,
        a heartbeat timeout (plus ``grace``) after it was given the rank. ``importing``:
        a warm spare still importing, which takes the rank once ready: until its own
        first beat it is judged hung only once its CPU time stands still (`_busy`)."""
        old = self.beats.get(rank)
        line = contract.heartbeat_line(
            -1 if old is None else old.step, time.time() + grace, pid, attempt
        )
        fd = Access.from_env().open(
            os.path.join(self.dir, contract.heartbeat_file(rank)), os.O_WRONLY
        )
        try:
            os.pwrite(fd, line, 0)
        finally:
            os.close(fd)
        if importing:
            self.importing[pid] = (contract.heartbeat_fields(line)[1], -1, 0.0)

    def _busy(self, pid: int, beat: float, now: float) -> bool:
        """Whether ``pid`` is a spare given a rank while still importing (`expect`) that
        has not beaten yet and whose CPU time grew within `BUSY_S`: importing, not hung.
        One stopped (SIGSTOP, a hung machine) uses no CPU time and is judged."""
        seen = self.importing.get(pid)
        if seen is None:
            return False
        expected, ticks, when = seen
        if beat != expected:  # its own beat: judged as every rank from now on
            del self.importing[pid]
            return False
        if now - when < BUSY_S:
            return True
        used = cpu_ticks(pid)
        if used is None or used == ticks:
            return False
        self.importing[pid] = (expected, used, now)
        return True

    def _last_step(self, pid: int, beat_step: int) -> int:
        """The last step an exited ``pid`` reached. Heartbeats are written at most every
        0.2 s, so the last one can be steps behind a rank that went on to finish; the
        step spans it flushed as it exited (read now: after this poll's first read), or
        if it was killed, its record of the last step (`unbroken.run.reached`), say
        where it ended."""
        self.read_events()
        spans_step, _ = self.timeline.last_step.get(pid, (beat_step, 0.0))
        records = [r["step"] for r in reached.read(self.dir) if r["pid"] == pid]
        return max(beat_step, spans_step, *records)

    def shutting_down(self, pid: int, beat: float, now: float) -> bool:
        """Whether ``pid`` closed its Checkpointer after its last beat, not too long ago:
        a process shutting down after its last step ticks no more, and may take longer
        than the heartbeat timeout on a loaded machine. A close that takes
        `CLOSE_GRACE` heartbeat timeouts is a hang after all."""
        closed = self.closing.get(pid)
        return closed is not None and beat <= closed and now - closed < CLOSE_GRACE * self.timeout

    def _read_beats(self) -> None:
        for name in os.listdir(self.dir):
            if not name.startswith(contract.HEARTBEAT_PREFIX):
                continue
            try:
                with open(os.path.join(self.dir, name), "rb") as f:
                    beat = Beat(*contract.heartbeat_fields(f.read()))
            except (OSError, ValueError):
                continue  # being written for the first time
            rank = int(name[len(contract.HEARTBEAT_PREFIX) :])
            self.beats[rank] = beat
            self.pace.saw(rank, beat.pid, beat.attempt, beat.t)
