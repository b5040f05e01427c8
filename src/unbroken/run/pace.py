"""How long a rank may go without a heartbeat before the watchdog judges it hung.

A fixed ``--heartbeat-timeout`` has to cover the slowest moment of a whole job (the
first step's compilation, a restore, a blocking save), so it is minutes where a step is
a fraction of a second, and a hung rank costs every rank those minutes. With
``--hang-factor F``, each rank's limit is learned from its own pace, as NVIDIA's
resiliency extension calculates its timeouts: once a rank has beaten `LEARN_BEATS`
times in a generation (after `SKIP_BEATS`: the generation's first steps restore, heal
and warm up), it is judged hung after ``F`` times the longest gap between two of its
beats seen so far in that generation, never sooner than `FLOOR_S`, never later than
the heartbeat timeout. A new generation (attempt) or process learns again.

The longest gap, not a mean: a step that saves, snapshots or collects garbage is one of
the rank's own gaps once it has happened, and the factor covers the rest. A loop whose
rare long pauses do not call ``unbroken.run.tick`` (an evaluation every thousand steps,
say) needs the fixed timeout, or a tick inside the pause.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

SKIP_BEATS = 5  # a generation's first beats, not learned from
LEARN_BEATS = 20  # beats learned from before a learned limit applies
FLOOR_S = 2.0  # no rank is judged hung sooner: a loaded host stalls a process this long


@dataclass
class _Learned:
    pid: int
    attempt: int
    last: float  # its last beat (wall clock)
    beats: int = 0  # distinct beats seen in this attempt
    longest: float = 0.0  # the longest gap between them, after SKIP_BEATS


class Pace:
    """Per-rank hang limits: ``ceiling`` (the heartbeat timeout, 0: no watchdog) until a
    rank's pace is learned, then ``factor`` times its longest gap (0: never learned)."""

    def __init__(self, ceiling: float, factor: float = 0.0) -> None:
        self.ceiling = ceiling
        self.factor = factor
        self.ranks: dict[int, _Learned] = {}

    @classmethod
    def of(cls, ours: argparse.Namespace) -> Pace:
        """From ``unbroken run``'s parsed options."""
        return cls(ours.heartbeat_timeout, ours.hang_factor)

    def saw(self, rank: int, pid: int, attempt: int, beat: float) -> None:
        """``rank``'s heartbeat file now reads ``beat``, written by ``pid`` in ``attempt``."""
        seen = self.ranks.get(rank)
        if seen is None or (seen.pid, seen.attempt) != (pid, attempt):
            self.ranks[rank] = _Learned(pid, attempt, beat)
            return
        if beat == seen.last:
            return
        # A launcher's own beat for a rank it starts is dated ahead, its grace to the
        # first step (`Watch.expect`): the rank's first real beat comes before it.
        seen.beats += 1
        if seen.beats > SKIP_BEATS:
            seen.longest = max(seen.longest, beat - seen.last)
        seen.last = beat

    def limit(self, rank: int) -> float:
        """How long ``rank`` may now go without a beat."""
        seen = self.ranks.get(rank)
        if not self.factor or seen is None or seen.beats < SKIP_BEATS + LEARN_BEATS:
            return self.ceiling
        return min(self.ceiling, max(FLOOR_S, self.factor * seen.longest))
