"""The step spans a kill took out of the event log, rebuilt from what survives it.

A worker buffers its step spans, so a process killed without warning takes those since
its last write with it: the very steps a restart computes again. What survives is the
last step each process reached, and when (`unbroken.run.reached`, read as a
``reached`` event). `restore` gives each process the spans it lost: the steps after the
last one its log holds for that attempt (else after the step it restored), up to the
one it reached, sharing evenly the time from its last surviving event to the end of the
step it reached. Each step's own span is not known, only their sum; whatever else was
buffered in that time (the events of a save, say) is lost too, and its time counts as
those steps'. The account then treats them as any other spans: a step executed again
later was recomputed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

Event = dict[str, Any]


def restore(events: list[Event]) -> list[Event]:
    """``events`` with each ``reached`` event replaced by the spans its process lost
    (a ``steps`` event with ``lost: true``), if it lost any."""
    out = [e for e in events if e["event"] != "reached"]
    by_process: dict[tuple[Any, int], list[Event]] = defaultdict(list)
    for e in out:  # a background persist is no step boundary: it overlaps the steps
        if "pid" in e and not e["event"].startswith("persist"):
            by_process[(e["pid"], e.get("attempt", 0))].append(e)
    for r in (e for e in events if e["event"] == "reached"):
        spans = _lost(by_process[(r["pid"], r["attempt"])], r["step"], r["t"])
        if spans:
            who = {k: r[k] for k in ("rank", "pid", "attempt")}
            out.append({"event": "steps", "t": r["t"], **who, "spans": spans, "lost": True})
    return out


def _lost(mine: list[Event], reached: int, t: float) -> list[list[Any]]:
    """The spans of the steps after the last one in ``mine`` (one process's attempt) up
    to ``reached``, which ended at ``t``; none if its log holds them all."""
    done = [s for e in mine if e["event"] == "steps" for s in e["spans"]]
    if done:
        last = max(s[0] for s in done)
    else:  # nothing written since the restore (None: from scratch); no restore: one step
        restores = [e for e in mine if e["event"] == "restore_done"]
        restored = max(restores, key=lambda e: e["t"], default=None)
        last = reached - 1 if restored is None else restored.get("step") or 0
    if reached <= last:
        return []
    ends = [s[2] for s in done] + [e["t"] for e in mine if e["event"] != "steps"]
    start = max((x for x in ends if x <= t), default=t)
    n = reached - last
    width = (t - start) / n
    return [[last + 1 + i, start + i * width, start + (i + 1) * width] for i in range(n)]
