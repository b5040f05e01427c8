"""A discrete-event simulation of a training job's time at cluster scale: checkpoints,
failures (a Poisson process at the job's MTBF, mixed process / node / hang) and the
recoveries of one strategy (`unbroken.goodput.costs.Costs`).

The job is in one state at a time: ``train``, ``checkpoint`` (training blocked), or one
recovery phase (``detection``, ``restart``, ``init``, ``restore``, ``data``). Events
(checkpoint start and end, phase ends, failures) come off one heap in time order; each
carries the epoch it was scheduled in, and a failure starts a new epoch, so whatever a
failure interrupts (a checkpoint, a recovery) never completes. A failure during a
recovery starts the recovery again. The time a state lasted goes to its cause, with the
names of `unbroken.goodput.account` (``productive``, ``checkpoint``, ...); the work lost
to a failure moves from ``productive`` to ``recompute``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from unbroken.goodput.costs import KINDS, Costs

PHASES = ("detection", "restart", "init", "restore", "data")


@dataclass
class Outcome:
    """Seconds by cause over the simulated horizon, and what happened."""

    seconds: dict[str, float]
    failures: int = 0
    recoveries: list[float] = field(default_factory=list)  # fault -> training again, s
    log: list[tuple[float, str]] = field(default_factory=list)  # (t, event), with log=True

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s else 0.0


class Job:
    """One simulated job: `run` it once."""

    def __init__(self, costs: Costs, interval_s: float, mix: tuple[float, ...], log: bool):
        self.c = costs
        self.interval = interval_s  # of training between checkpoints
        self.mix = mix
        self.keep_log = log
        self.heap: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.epoch = 0
        self.state = "train"
        self.since = 0.0  # when the state began
        self.work = 0.0  # productive seconds so far (lost work taken back)
        self.safe = 0.0  # work that a failure keeps: the last checkpoint
        self.fault_t: float | None = None  # the failure being recovered from
        self.out = Outcome(
            seconds=dict.fromkeys(("productive", "checkpoint", "recompute", *PHASES), 0.0)
        )

    def at(self, t: float, what: str) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, what, self.epoch))

    def enter(self, t: float, state: str) -> None:
        """Leave the current state at ``t`` (its time to its cause), enter ``state``."""
        spent = t - self.since
        if self.state == "train":
            self.work += spent
            self.out.seconds["productive"] += spent
        else:
            self.out.seconds[self.state] += spent
        self.state, self.since = state, t

    def run(self, horizon_s: float, failures: Iterable[tuple[float, str]]) -> Outcome:
        for t, kind in failures:
            self.at(t, f"fail:{kind}")
        self.at(horizon_s, "end")
        self.at(self.interval, "checkpoint")
        while self.heap:
            t, _, what, epoch = heapq.heappop(self.heap)
            if epoch != self.epoch and not what.startswith(("fail", "end")):
                continue  # interrupted by a failure
            if self.keep_log:
                self.out.log.append((t, what))
            if what == "end":
                self.enter(t, "end")
                break
            self.handle(t, what)
        return self.out

    def handle(self, t: float, what: str) -> None:
        c = self.c
        if what.startswith("fail:"):
            self.fail(t, what[5:])
        elif what == "checkpoint":
            self.enter(t, "checkpoint")
            self.at(t + c.stall, "checkpoint_done")
        elif what == "checkpoint_done":
            self.enter(t, "train")
            self.safe = self.work
            self.at(t + self.interval, "checkpoint")
        elif what in PHASES:  # the phase ``what`` is over: the next one, or training
            nxt = PHASES.index(what) + 1
            if nxt < len(PHASES):
                self.enter(t, PHASES[nxt])
                self.at(t + self.phase_s(PHASES[nxt], ""), PHASES[nxt])
            else:
                self.enter(t, "train")
                assert self.fault_t is not None
                self.out.recoveries.append(t - self.fault_t)
                self.fault_t = None
                self.at(t + self.interval, "checkpoint")

    def phase_s(self, phase: str, kind: str) -> float:
        c = self.c
        return {
            "detection": c.detect.get(kind, 0.0),
            "restart": c.restart,
            "init": c.init,
            "restore": c.restore,
            "data": c.data,
        }[phase]

    def fail(self, t: float, kind: str) -> None:
        self.epoch += 1
        self.out.failures += 1
        self.enter(t, "detection")
        lost = self.work - self.safe if self.c.lose_since_checkpoint else 0.0
        if not self.c.lose_since_checkpoint:  # live healing: the step in flight
            lost = min(self.work - self.safe, self.c.step_s / 2)
        self.work -= lost
        self.out.seconds["productive"] -= lost
        self.out.seconds["recompute"] += lost
        self.safe = self.work
        if self.fault_t is None:
            self.fault_t = t
        self.at(t + self.phase_s("detection", kind), "detection")


def poisson_failures(
    mtbf_s: float, horizon_s: float, mix: tuple[float, ...], seed: int
) -> list[tuple[float, str]]:
    """Failure times (exponential gaps at ``mtbf_s``) and kinds (by ``mix``)."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        out.append((t, rng.choices(KINDS, weights=mix)[0]))


def simulate(
    costs: Costs,
    interval_s: float,
    mtbf_s: float,
    horizon_s: float,
    mix: tuple[float, ...] = (0.5, 0.4, 0.1),
    seed: int = 0,
    failures: list[tuple[float, str]] | None = None,
    log: bool = False,
) -> Outcome:
    """Simulate ``horizon_s`` of a job checkpointing every ``interval_s`` of training;
    ``failures`` (time, kind) replaces the Poisson ones (``mtbf_s``, ``mix``, ``seed``)."""
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, not {interval_s}")
    if failures is None:
        failures = poisson_failures(mtbf_s, horizon_s, mix, seed)
    return Job(costs, interval_s, mix, log).run(horizon_s, failures)
