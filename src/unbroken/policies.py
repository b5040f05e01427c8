"""When to take memory snapshots and persistent saves.

Policies are pure objects: they look at the step and the clock and decide, and never do
IO themselves, so every one of them is tested by a table.
"""

from __future__ import annotations

import math


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval, in seconds, that loses the least time to checkpoints and
    to recomputation together: Young/Daly's first-order optimum, sqrt(2 * C * MTBF),
    where ``cost_s`` is what one checkpoint blocks training for and ``mtbf_s`` the mean
    time between failures of the whole job."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"young_daly needs cost_s >= 0 and mtbf_s > 0, got {cost_s}, {mtbf_s}")
    return math.sqrt(2.0 * cost_s * mtbf_s)
