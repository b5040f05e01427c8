"""The heal's plan (`unbroken.healing.live`), made alike on every rank from the rows all
of them gathered: the step to heal at, and for each rank to heal where its state and its
record come from. Pure: no process group, no state."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from unbroken.healing import inflight

log = logging.getLogger("unbroken")


@dataclass(frozen=True)
class Plan:
    """Heal at ``step``: each rank to heal (lost, or a step behind) gets its tensors
    from ``source[rank]`` and its record from ``holder[rank]``; a rank in ``rebuilt``
    gets its prepared record there instead, rebuilt with the listed entries of its
    source's record (`unbroken.healing.inflight`)."""

    step: int
    source: dict[int, int]
    holder: dict[int, int]
    rebuilt: dict[int, list[str]] = field(default_factory=dict)


def plan(table: list[dict[str, Any]]) -> Plan | None:
    """The plan for the gathered ``{"live": step or None, "held": {owner: steps},
    "peers": ranks holding the same replicated state, or None for any, "flight": ...}``
    of every rank, or None if healing cannot be exact. The heal's step is the newest live
    step; a live rank one step behind it (stopped in the barrier of a step the others
    applied) is healed forward like a lost rank. A rank's source is a rank live at the
    step that each of the two counts as a peer (under HSDP: the same shard, in another
    replica group)."""
    live = [r for r, row in enumerate(table) if row["live"] is not None]
    steps = sorted({table[r]["live"] for r in live})
    if not live or steps[-1] - steps[0] > 1:
        return None
    step = steps[-1]
    ahead = [r for r in live if table[r]["live"] == step]
    holder, source, rebuilt = {}, {}, {}
    for i, r in enumerate(r for r in range(len(table)) if r not in ahead):
        holders = [q for q in ahead if step in table[q]["held"].get(str(r), [])]
        sources = [q for q in ahead if _peers(table, r, q)]
        if not holders and (prepared := inflight.rebuild(table, ahead, r)) is not None:
            holders, rebuilt[r] = [prepared[0]], prepared[1]
        if not holders or not sources:
            why = "its step record" if not holders else "a replica of its state"
            log.info("rank %d cannot be healed at step %d: no live rank holds %s", r, step, why)
            return None
        holder[r], source[r] = holders[0], sources[i % len(sources)]
    return Plan(step, source, holder, rebuilt)


def _peers(table: list[dict[str, Any]], a: int, b: int) -> bool:
    of_a, of_b = table[a].get("peers"), table[b].get("peers")
    return (of_a is None or b in of_a) and (of_b is None or a in of_b)
