"""Which committed checkpoints to keep: pure objects, no IO, tested by tables.

Each rule says which steps it keeps; combined with ``|``, a step is kept if any rule
keeps it. `doomed` applies one to the known checkpoints and never returns the newest,
nor a protected step (one a restore of this job is reading).

    KeepLast(3) | KeepEvery(10_000) | KeepPerWindow(86_400) | KeepBest(2, mode="min")
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True)
class Info:
    """What retention knows of a committed step: when it was committed (seconds since
    the epoch) and the metric passed to `Checkpointer.save`, if any."""

    step: int
    created: float = 0.0
    metric: float | None = None


class Retention(Protocol):
    """A rule: the steps it keeps of ``infos`` (every committed step, oldest first)."""

    def keeps(self, infos: Sequence[Info]) -> set[int]: ...


class _Combinable:
    def __or__(self, other: Retention) -> KeepAny:
        return KeepAny((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True)
class KeepLast(_Combinable):
    """The newest ``count`` steps (``Checkpointer(keep=K)`` is ``KeepLast(K)``)."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"KeepLast({self.count}): the newest checkpoint is always kept")

    def keeps(self, infos: Sequence[Info]) -> set[int]:
        return {i.step for i in sorted(infos, key=lambda i: i.step)[-self.count :]}


@dataclass(frozen=True)
class KeepEvery(_Combinable):
    """Every step that is a multiple of ``steps``, forever."""

    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"KeepEvery({self.steps}): at least 1")

    def keeps(self, infos: Sequence[Info]) -> set[int]:
        return {i.step for i in infos if i.step % self.steps == 0}


@dataclass(frozen=True)
class KeepPerWindow(_Combinable):
    """The newest step of each window of ``seconds`` (by commit time, windows aligned
    to the epoch: ``86400`` keeps one a day, UTC)."""

    seconds: float

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"KeepPerWindow({self.seconds}): the window is > 0 seconds")

    def keeps(self, infos: Sequence[Info]) -> set[int]:
        newest: dict[int, Info] = {}
        for i in infos:
            window = int(i.created // self.seconds)
            if window not in newest or i.step > newest[window].step:
                newest[window] = i
        return {i.step for i in newest.values()}


@dataclass(frozen=True)
class KeepBest(_Combinable):
    """The ``count`` steps with the best metric (``"min"``: lowest, e.g. a loss), ties
    to the newer. Steps saved without a metric are not ranked (other rules decide)."""

    count: int
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if self.count < 1 or self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest({self.count}, {self.mode!r}): count >= 1, min or max")

    def keeps(self, infos: Sequence[Info]) -> set[int]:
        ranked = [i for i in infos if i.metric is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        ranked.sort(key=lambda i: (sign * float(i.metric or 0.0), -i.step))
        return {i.step for i in ranked[: self.count]}


@dataclass(frozen=True)
class KeepAny(_Combinable):
    """Keeps what any of ``rules`` keeps (what ``a | b`` builds)."""

    rules: tuple[Retention, ...]

    def keeps(self, infos: Sequence[Info]) -> set[int]:
        return set().union(*(r.keeps(infos) for r in self.rules))


def doomed(
    rule: Retention | None, infos: Sequence[Info], protected: Collection[int] = ()
) -> list[int]:
    """The steps of ``infos`` that ``rule`` lets go, oldest first; never the newest
    step, nor one in ``protected``. ``None`` keeps everything."""
    if rule is None or not infos:
        return []
    newest = max(i.step for i in infos)
    kept = rule.keeps(infos) | {newest} | set(protected)
    return sorted(i.step for i in infos if i.step not in kept)
