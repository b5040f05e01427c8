"""bench/storm.py's accounting of one method's run, from the events its processes wrote
(bench/storm_job.py) and the faults the driver struck: the same yardstick for every
method, whatever logs the method itself keeps.

The job's progress is read off one rank (the one that finished first): each of its
step events in time order is a completion. Time from a fault, or from a restart's
``restored``, to the next completion is recovery; a completion that a later one of the
same step replaced was lost work (recomputation); a step's checkpoint calls are
checkpoint time; the first completion's wait from the launch is start-up; the rest of a
kept step's time is productive. Steps more than 3x the median long with no fault inside
are counted as stalls. Productive time beyond the reference's own step time, over as
many steps, is counted apart as ``slower`` (`slower`): steps that background work, or
another process on the same cores, slowed down."""

from __future__ import annotations

import json
import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any

CAUSES = ("startup", "checkpoint", "recovery", "recomputation", "stall")


def read(out: Path) -> list[dict[str, Any]]:
    events = []
    for path in out.glob("events-*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    return sorted(events, key=lambda e: e["t"])


def observer(events: list[dict[str, Any]]) -> int:
    """The rank that finished first: the job's end is its ``final``."""
    return int(min((e for e in events if e["event"] == "final"), key=lambda e: e["t"])["rank"])


def ended(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events up to the job's end (a straggler's, after it, are not the job's)."""
    end = min(e["t"] for e in events if e["event"] == "final")
    return [e for e in events if e["t"] <= end]


def account(events: list[dict[str, Any]], faults: list[dict[str, Any]], t0: float) -> dict:
    """Wall time, goodput and badput by cause (seconds), steps recomputed."""
    events = ended(events)
    rank = observer(events)
    mine = [e for e in events if e["rank"] == rank and e["event"] in ("step", "restored")]
    steps = [e for e in mine if e["event"] == "step"]
    lasts = {e["step"]: i for i, e in enumerate(steps)}  # the kept completion of each step
    gaps = [b["t"] - a["t"] for a, b in pairwise(steps)]
    typical = statistics.median(gaps) if gaps else 0.0
    fault_times = [f["t"] for f in faults]
    spent = dict.fromkeys(("productive", *CAUSES), 0.0)
    productive_steps = 0
    before, restarted = t0, True  # the launch is a start
    for i, e in enumerate(steps):
        dt = e["t"] - before
        hit = any(before < t <= e["t"] for t in fault_times)
        restarted = restarted or any(
            r["event"] == "restored" and before < r["t"] <= e["t"] for r in mine
        )
        if i == 0:
            spent["startup"] += dt
        elif restarted or hit:
            spent["recovery"] += dt
        elif lasts[e["step"]] != i:
            spent["recomputation"] += dt
        elif dt > 3 * typical:
            spent["stall"] += dt
        else:
            spent["checkpoint"] += min(e["ckpt_s"], dt)
            spent["productive"] += dt - min(e["ckpt_s"], dt)
            productive_steps += 1
        before, restarted = e["t"], False
    wall = events[-1]["t"] - t0
    return {
        "wall_s": round(wall, 2),
        "goodput": round(spent["productive"] / wall, 4),
        "badput_s": {k: round(spent[k], 2) for k in CAUSES},
        "steps_recomputed": len(steps) - len(lasts),
        "observer_rank": rank,
        "median_step_s": round(typical, 4),
        "productive": {"s": spent["productive"], "steps": productive_steps},
    }


def slower(result: dict[str, Any], reference: dict[str, Any]) -> float:
    """Seconds of ``result``'s productive time beyond the reference's mean productive
    step, over as many steps: what slower steps cost, not counted under any cause."""
    mine, ref = result["productive"], reference["productive"]
    return mine["s"] - mine["steps"] * ref["s"] / max(1, ref["steps"])


def kept_losses(events: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """Each rank's loss at each step, as its kept (last) completion logged it."""
    return {(e["rank"], e["step"]): e["loss"] for e in events if e["event"] == "step"}


def compare(events: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the final parameters and every step's loss are bitwise the reference's."""
    events = ended(events)
    mine, ref = kept_losses(events), kept_losses(reference)
    # A rank killed between its step and its event never logged that loss: not compared.
    both = [k for k in ref if k in mine]
    differ = sum(1 for k in both if mine[k] != ref[k])
    digests = {e["digest"] for e in events if e["event"] == "final"}
    (want,) = {e["digest"] for e in reference if e["event"] == "final"}
    return {
        "final_bitwise": digests == {want},
        "losses_bitwise": differ == 0,
        "losses_differing": differ,
        "losses_compared": len(both),
        "losses_in_reference": len(ref),
    }


def timeline(events: list[dict[str, Any]], t0: float) -> list[tuple[float, int]]:
    """(seconds since launch, step) of the observer rank's completions, for the plot."""
    rank = observer(events)
    return [(e["t"] - t0, e["step"]) for e in ended(events)
            if e["event"] == "step" and e["rank"] == rank]  # fmt: skip
