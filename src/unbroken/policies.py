"""When to take memory snapshots and persistent saves.

Policies are pure objects: they look at the step and the clock and decide, and never do
IO themselves, so every one of them is tested by a table. `Checkpointer.step` asks its
`Policy` once per training step and does what it says; `snapshot` and `save` stay for
loops that decide themselves.

    Policy(snapshot=Every(steps=50), save=Every(seconds=1800) | At([1000, 5000]))
    Auto(mtbf_s=6 * 3600)  # both intervals from measured costs, by Young/Daly

A decision that reads the clock (`Every(seconds=...)`, `Auto`) could differ between
ranks; the checkpointer then takes rank 0's (see `Checkpointer.step`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

log = logging.getLogger("unbroken")

Action = Literal["save", "snapshot", "none"]


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval, in seconds, that loses the least time to checkpoints and
    to recomputation together: Young/Daly's first-order optimum, sqrt(2 * C * MTBF),
    where ``cost_s`` is what one checkpoint blocks training for and ``mtbf_s`` the mean
    time between failures of the whole job."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"young_daly needs cost_s >= 0 and mtbf_s > 0, got {cost_s}, {mtbf_s}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def expected_goodput(interval_s: float, cost_s: float, mtbf_s: float) -> float:
    """The fraction of time spent on useful training with a checkpoint of cost
    ``cost_s`` every ``interval_s`` seconds, to first order: each interval loses the
    checkpoint, and each failure half an interval of recomputation."""
    if interval_s <= 0:
        return 0.0
    return max(0.0, 1.0 - cost_s / interval_s - interval_s / (2.0 * mtbf_s))


class Trigger(Protocol):
    """When one kind of checkpoint is due. ``last_step``/``last_time`` are those of the
    last checkpoint of that kind (or of the first step seen, for the clock)."""

    @property
    def uses_clock(self) -> bool: ...

    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool: ...


class _Combinable:
    def __or__(self, other: Trigger) -> AnyOf:
        return AnyOf((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Every(_Combinable):
    """Due at every multiple of ``steps`` (so resumed jobs keep the same steps), or
    once ``seconds`` have passed since the last checkpoint of its kind. One of the two."""

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.seconds is None):
            raise ValueError("Every(steps=N) or Every(seconds=T): exactly one of the two")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"Every(steps={self.steps}): at least 1")
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError(f"Every(seconds={self.seconds}): more than 0")

    @property
    def uses_clock(self) -> bool:
        return self.seconds is not None

    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool:
        if self.steps is not None:
            return step % self.steps == 0
        assert self.seconds is not None
        return now - last_time >= self.seconds


@dataclass(frozen=True)
class At(_Combinable):
    """Due at each of the listed steps."""

    steps: frozenset[int]
    uses_clock = False

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(steps))

    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool:
        return step in self.steps


@dataclass(frozen=True)
class Never(_Combinable):
    """Never due: the default for a kind of checkpoint a policy does not take."""

    uses_clock = False

    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool:
        return False


@dataclass(frozen=True)
class AnyOf(_Combinable):
    """Due when any of ``triggers`` is (what ``a | b`` builds)."""

    triggers: tuple[Trigger, ...]

    @property
    def uses_clock(self) -> bool:
        return any(t.uses_clock for t in self.triggers)

    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool:
        return any(t.due(step, now, last_step, last_time) for t in self.triggers)


@dataclass
class _Last:
    step: int | None = None
    time: float | None = None


class SavePolicy(Protocol):
    """What `Checkpointer.step` asks each step. ``decide`` looks at the step and the
    clock only; ``done`` tells the policy what was taken and what it cost (the seconds
    the loop was blocked). Neither does IO."""

    @property
    def uses_clock(self) -> bool: ...

    def decide(self, step: int, now: float) -> Action: ...

    def done(self, action: Action, step: int, now: float, cost_s: float) -> None: ...


@dataclass
class Policy:
    """Memory snapshots by one trigger, persistent saves by another. A persistent save
    that is due wins over a snapshot at the same step (restore prefers the newest copy
    anyway). ``blocking`` saves return once committed; by default they persist in the
    background (see `Checkpointer.save`)."""

    snapshot: Trigger = field(default_factory=Never)
    save: Trigger = field(default_factory=Never)
    blocking: bool = False
    _last: dict[str, _Last] = field(default_factory=dict, init=False, repr=False)

    @property
    def uses_clock(self) -> bool:
        return self.snapshot.uses_clock or self.save.uses_clock

    def decide(self, step: int, now: float) -> Action:
        for kind, trigger in (("save", self.save), ("snapshot", self.snapshot)):
            last = self._last.setdefault(kind, _Last(time=now))
            if last.step == step:
                return "none"  # taken already (a step repeated after a skipped one)
            assert last.time is not None
            if trigger.due(step, now, last.step, last.time):
                return kind  # type: ignore[return-value]
        return "none"

    def done(self, action: Action, step: int, now: float, cost_s: float) -> None:
        if action != "none":
            self._last[action] = _Last(step, now)
            if action == "save":  # a save is at least as good as a snapshot
                self._last["snapshot"] = _Last(step, now)


@dataclass
class Auto:
    """Both intervals chosen by Young/Daly from what checkpoints cost here: the time a
    memory snapshot blocks the loop, the time a save blocks it (the staging copy of a
    background save, the whole save of a blocking one), and the mean time between
    failures: ``mtbf_s`` for any failure, ``storage_mtbf_s`` for those that lose the
    node's memory (default: every failure; only storage survives it then). Costs are
    measured on every checkpoint taken (an exponential average), so the intervals follow
    when costs change; the first step of each kind measures. Each choice that moves an
    interval by more than a quarter is logged with the goodput it expects.

    ``snapshots`` needs ``Checkpointer(memory=True)``."""

    mtbf_s: float
    storage_mtbf_s: float | None = None
    snapshots: bool = False
    blocking: bool = False
    uses_clock = True
    _step_s: float | None = field(default=None, init=False)
    _cost: dict[str, float] = field(default_factory=dict, init=False)
    _every: dict[str, int] = field(default_factory=dict, init=False)
    _last: dict[str, int] = field(default_factory=dict, init=False)
    _prev: tuple[int, float] | None = field(default=None, init=False)
    _spent: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.mtbf_s <= 0 or (self.storage_mtbf_s is not None and self.storage_mtbf_s <= 0):
            raise ValueError(f"Auto: MTBFs must be > 0, got {self.mtbf_s}, {self.storage_mtbf_s}")

    def intervals(self) -> dict[str, int]:
        """The current intervals in steps, by kind (empty until measured)."""
        return dict(self._every)

    def decide(self, step: int, now: float) -> Action:
        if self._prev is not None and step > self._prev[0]:
            took = (now - self._prev[1] - self._spent) / (step - self._prev[0])
            if took > 0:
                self._step_s = _average(self._step_s, took)
        self._prev, self._spent = (step, now), 0.0
        if self._step_s is None:
            return "none"  # one step first: intervals are counted in steps
        for kind in self._kinds():
            if kind not in self._cost:
                return kind  # measure it
        for kind in self._kinds():
            if step - self._last.get(kind, step) >= self._every[kind]:
                return kind
        return "none"

    def done(self, action: Action, step: int, now: float, cost_s: float) -> None:
        if action == "none":
            return
        self._spent += cost_s
        self._cost[action] = _average(self._cost.get(action), cost_s)
        self._last[action] = step
        if action == "save":
            self._last["snapshot"] = step
        self._choose()

    def _kinds(self) -> tuple[Literal["save", "snapshot"], ...]:
        return ("save", "snapshot") if self.snapshots else ("save",)

    def _mtbf(self, kind: str) -> float:
        if kind == "snapshot" or self.storage_mtbf_s is None:
            return self.mtbf_s
        return self.storage_mtbf_s

    def _choose(self) -> None:
        if self._step_s is None or any(k not in self._cost for k in self._kinds()):
            return
        chosen: dict[str, int] = {}
        for kind in self._kinds():
            seconds = young_daly(self._cost[kind], self._mtbf(kind))
            chosen[kind] = max(1, round(seconds / self._step_s))
        moved = any(
            abs(chosen[k] - self._every.get(k, 0)) > 0.25 * max(1, self._every.get(k, 0))
            for k in chosen
        )
        self._every = chosen
        if moved:
            log.info(
                "auto policy: %s; step %.3f s, MTBF %.0f s; expected goodput %.1f%%",
                ", ".join(
                    f"{k} every {n} steps (costs {self._cost[k]:.3f} s)" for k, n in chosen.items()
                ),
                self._step_s,
                self.mtbf_s,
                100 * self.goodput(),
            )

    def goodput(self) -> float:
        """The goodput the current intervals should give, to first order: each kind loses
        its cost per interval, and half an interval per failure it is restored from."""
        if self._step_s is None or not self._every:
            return 0.0
        lost = 0.0
        for kind, n in self._every.items():
            interval = n * self._step_s
            lost += self._cost[kind] / interval
            lost += interval / (2.0 * self._mtbf(kind))
        return max(0.0, 1.0 - lost)


def _average(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new
