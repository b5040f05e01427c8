"""bench/storm.py's check of ``unbroken simulate``: the simulator's model
(`unbroken.goodput.simulate`), given the per-fault costs one method's run measured and
that run's own fault schedule, predicts the method's goodput, to set beside the
measured one.

What the model is given, from the run: each fault kind's time from the fault to the next
completed step (the mean over the run's faults of that kind, as a goodput adds times:
detection, restart, restore and the first step lumped into "detection"), the checkpoint
stall and its interval in steps ((a): DCP's saves; (b): the snapshots, which bound the
lost work; (c): ``Checkpointer.step`` every step, with live healing losing at most the
step in flight), the step time and the start-up before the first step. What it leaves
out is in docs/simulation.md."""

from __future__ import annotations

import math
import statistics
from typing import Any

from unbroken.goodput.costs import Costs
from unbroken.goodput.simulate import simulate

KIND = {"crash": "process", "node": "node", "hang": "hang"}
INTERVAL = {"a": None, "b": 5, "c": 1}  # steps between what bounds the lost work (a: K)


def recoveries(events: list[dict[str, Any]], faults: list[dict[str, Any]], rank: int) -> dict:
    """Per fault kind, the mean time from a fault to the observer's next step: a goodput
    adds times, and the median drops the costly ones (a crash inside another fault's
    recovery took (a) 23 s, where its other crashes took 12 s)."""
    steps = [e["t"] for e in events if e["event"] == "step" and e["rank"] == rank]
    restores = [e["t"] for e in events if e["event"] == "restored" and e["rank"] == rank]
    by: dict[str, list[float]] = {}
    for f, nxt in zip(faults, [*(g["t"] for g in faults[1:]), math.inf], strict=False):
        # Training again: the first step after the restart this fault caused (the step
        # in flight may still complete first), or after the fault where none restarted.
        restart = [t for t in restores if f["t"] < t < nxt]
        after = [t for t in steps if t > (restart[0] if restart else f["t"])]
        if after:
            by.setdefault(KIND[f["kind"]], []).append(after[0] - f["t"])
    everything = [s for times in by.values() for s in times]
    fallback = statistics.fmean(everything) if everything else 0.0
    return {k: statistics.fmean(by[k]) if k in by else fallback for k in KIND.values()}


def predict(
    key: str, events: list[dict[str, Any]], faults: list[dict[str, Any]], measured: dict,
    t0: float, save_every: int,
) -> float:  # fmt: skip
    """The goodput the model predicts for method ``key``'s run."""
    rank = measured["observer_rank"]
    every = INTERVAL[key] or save_every
    mine = [e for e in events if e["event"] == "step" and e["rank"] == rank]
    paid = [e["ckpt_s"] for e in mine if e["step"] % every == 0]
    # Training time per step: the step's median less what its checkpoint calls took.
    step_s = measured["median_step_s"] - statistics.mean(e["ckpt_s"] for e in mine)
    costs = Costs(
        strategy=key,
        detect=recoveries(events, faults, rank),
        restart=0.0, init=0.0, restore=0.0, data=0.0,
        stall=statistics.median(paid) if paid else 0.0,
        lose_since_checkpoint=key != "c",
        step_s=step_s,
    )  # fmt: skip
    startup = measured["badput_s"]["startup"]
    wall = measured["wall_s"]
    failures = [(f["t"] - t0 - startup, KIND[f["kind"]]) for f in faults]
    # The stall is paid on top of each interval's training: interval = steps x step time.
    out = simulate(costs, every * step_s, 1.0, wall - startup, failures=failures)
    return out.seconds["productive"] / wall
