"""The watchdog's learned hang limit (`unbroken.run.pace`, ``--hang-factor``): a rank's
limit follows its own longest gap between beats, starts over with each generation, and
stays between `FLOOR_S` and the heartbeat timeout."""

from __future__ import annotations

import pytest

from unbroken.run.args import parse
from unbroken.run.pace import FLOOR_S, LEARN_BEATS, SKIP_BEATS, Pace


def beats(pace: Pace, gaps: list[float], pid: int = 10, attempt: int = 0, t: float = 0.0) -> None:
    """Rank 0's beats from ``t``, ``gaps`` apart, each read twice (polls between beats)."""
    rank = 0
    pace.saw(rank, pid, attempt, t)
    for gap in gaps:
        t += gap
        pace.saw(rank, pid, attempt, t)
        pace.saw(rank, pid, attempt, t)  # read again before the next beat: no new gap


def test_the_limit_is_the_factor_times_the_longest_gap_once_learned() -> None:
    pace = Pace(60.0, 5.0)
    gaps = [0.3] * (SKIP_BEATS + LEARN_BEATS - 2) + [0.8]
    beats(pace, gaps)
    assert pace.limit(0) == 60.0, "not learned yet"
    beats(pace, [*gaps, 0.3])
    assert pace.limit(0) == pytest.approx(5 * 0.8)
    assert pace.limit(1) == 60.0, "a rank never seen keeps the heartbeat timeout"


def test_the_first_gaps_of_a_generation_are_not_learned() -> None:
    pace = Pace(60.0, 5.0)
    beats(pace, [9.0] * SKIP_BEATS + [0.4] * LEARN_BEATS)  # a restore and a heal
    assert pace.limit(0) == pytest.approx(2.0)


def test_a_new_generation_or_process_learns_again() -> None:
    pace = Pace(60.0, 5.0)
    beats(pace, [0.4] * (SKIP_BEATS + LEARN_BEATS))
    assert pace.limit(0) == pytest.approx(2.0)
    beats(pace, [0.4] * (SKIP_BEATS + LEARN_BEATS - 1), attempt=1, t=100.0)
    assert pace.limit(0) == 60.0, "generation 1 is not learned yet"
    pace.saw(0, 10, 1, 100.0 + 0.4 * (SKIP_BEATS + LEARN_BEATS))
    assert pace.limit(0) == pytest.approx(2.0)
    pace.saw(0, 11, 1, 300.0)  # a replacement process for the rank
    assert pace.limit(0) == 60.0


def test_the_limit_stays_between_the_floor_and_the_heartbeat_timeout() -> None:
    fast, slow, off = Pace(60.0, 5.0), Pace(3.0, 5.0), Pace(60.0)
    for pace in (fast, slow, off):
        beats(pace, [0.01] * (SKIP_BEATS + LEARN_BEATS))
    assert fast.limit(0) == FLOOR_S
    beats(slow, [2.0] * (SKIP_BEATS + LEARN_BEATS))
    assert slow.limit(0) == 3.0
    assert off.limit(0) == 60.0, "factor 0: the heartbeat timeout alone"


@pytest.mark.parametrize(
    "options",
    [["--hang-factor=0.5"], ["--hang-factor=-1"], ["--heartbeat-timeout=0", "--hang-factor=5"]],
)
def test_a_hang_factor_below_one_or_without_a_timeout_is_refused(options, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse([*options, "--max-restarts=1", "train.py"])
    assert e.value.code == 2
    assert "--hang-factor" in capsys.readouterr().err
