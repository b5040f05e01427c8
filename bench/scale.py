# mypy: disallow-untyped-defs
"""The scale harness: unbroken's control plane at 64 to 4,096 simulated ranks (8 per
node) on one small machine, phase by phase, with the store requests of each.

    python bench/scale.py                          # 64, 256, 1024, 2304, 4096 ranks
    python bench/scale.py --ranks 64,256 --plot docs/scaling.png
    python bench/scale.py --smoke                  # CI: seconds

Per world size ``n``, a node of 8 ranks is lost and the job recovers, then a save and a
restore's metadata are made. The phases, what runs and what is simulated:

- detection, abort, generation start (bench/scale_protocol.py): a real `TCPStore` and
  `Coordinator`, ``n/8`` `NodeAgent`s running their own store code, and the store
  traffic of ``n`` ranks' `in_process`, all threads, the agents and ranks in host
  processes of 16 nodes (bench/scale_hosts.py); simulated: the node's death (no worker
  process, no training);
- group creation (bench/scale_groups.py): the generation's two lazy gloo groups, real
  `ProcessGroupGloo`s on real store connections, ``n`` threads in the same hosts;
- step agreement, heal plan, save plan, manifest validation (bench/scale_metadata.py):
  `step_choice._in_memory`, `healing.plan.plan` on rank 0 with every rank's rows; the
  save's `saving.planning.Planner` on rank 0 (its time beside the phase's) and a
  non-planning rank's rows and parts; a restore rank's part of the manifest checked
  (`format.layout.parse`) and the manifest built; simulated: the transport (messages
  counted, not timed). Their times are the thread's CPU seconds.

The data plane is left out: no tensor moves. Times are wall seconds on this machine,
where every party shares 2 cores that a cluster would give each node its own: upper
bounds for the protocol, and rank 0's CPU for the metadata. Store requests are counted
exactly (Python calls through counting stores). The growth of each phase is the slope
of a least-squares line through (log n, log value) over the sizes measured; a size a
phase cannot run at gets the fitted line's value, marked projected. Ends with
``RESULT {json}``; docs/scaling.md ("Measured on the harness") shows a run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see scale_protocol.py
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # one warning per connection here

import scale_groups
import scale_hosts
import scale_metadata
import scale_protocol
from common import new_table, print_result, show

PHASES = (
    "detection",
    "abort",
    "generation start",
    "group creation",
    "step agreement",
    "heal plan",
    "save plan",
    "manifest validation",
)
SIZES = (64, 256, 1024, 2304, 4096)
# One rank's own cost, fitted beside its phase's: the whole save's plan (O(n) once, on
# rank 0), and one rank's gloo constructor made alone (what each rank of a cluster pays
# at once, where the harness's time is every rank's on 2 cores).
BESIDE: dict[str, tuple[str, Callable[[dict[str, Any]], float]]] = {
    "save plan": ("rank 0 plans", lambda r: r["planner_s"]),
    "group creation": ("a rank's alone", lambda r: r["alone_s"]),
}
SMOKE = (16, 64)
# n log n's slope on log-log between 256 and 4,096 ranks is 1 + 1/ln(1024) ~ 1.14; a
# phase whose fitted slope is above this margin grows faster than n log n.
NLOGN_SLOPE = 1.2


def measure(world: int, tensors: int, protocol_max: int) -> dict[str, dict[str, Any]]:
    """Every phase that runs at ``world`` ranks (the others are projected later)."""
    out: dict[str, dict[str, Any]] = {}
    if world <= protocol_max:
        protocol = scale_protocol.run(world)
        for name in scale_protocol.PHASES:
            note = f"{world // 8 + 1} agents, {world} ranks, host processes: {protocol['hosts']}"
            out[name] = {**protocol[name], "note": note}
        out["detection"]["idle_requests_per_s"] = protocol["idle_requests_per_s"]
    if world <= scale_groups.MAX_RANKS:
        out["group creation"] = scale_groups.measure(world)
    out.update(scale_metadata.measure(world, tensors))
    for row in out.values():
        row["how"] = "measured"
    return out


def slope(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(k, c) of value = c * n^k, least squares on log-log; None under two points."""
    pts = [(math.log(n), math.log(v)) for n, v in points if v > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = statistics.mean(x for x, _ in pts), statistics.mean(y for _, y in pts)
    k = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return k, math.exp(my - k * mx)


Runs = dict[int, dict[str, dict[str, Any]]]  # ranks -> phase -> its row


def fit(runs: Runs) -> dict[str, Any]:
    """Per phase, the growth of its time and requests over the measured sizes, and the
    projection of every size it did not run at."""
    growth: dict[str, Any] = {}
    for phase in PHASES:
        measured = {n: r[phase] for n, r in runs.items() if phase in r}
        lines = {
            what: slope([(n, float(r[what])) for n, r in measured.items()])
            for what in ("s", "requests")
        }
        growth[phase] = {what: None if line is None else round(line[0], 3)
                         for what, line in lines.items()}  # fmt: skip
        if phase in BESIDE:  # and one rank's own cost beside the phase's
            line = slope([(n, BESIDE[phase][1](r)) for n, r in measured.items()])
            growth[phase]["beside"] = None if line is None else round(line[0], 3)
        for n, r in runs.items():
            if phase in r:
                continue
            r[phase] = {"how": "projected", "note": f"fit of {sorted(measured)}"}
            for what, line in lines.items():
                r[phase][what] = None if line is None else line[1] * n ** line[0]
    return growth


def report(runs: Runs, growth: dict[str, Any]) -> None:
    table = new_table(
        "Control plane at scale: a node of 8 lost and recovered, a save and a restore's metadata",
        "wall seconds on this 2-core machine (protocol: every party shares it); store "
        "requests counted exactly; 'projected': the fit of the measured sizes, not a run",
        [("ranks", "right"), ("phase", "left"), ("seconds", "right"),
         ("store requests", "right"), ("how", "left"), ("note", "left")],
    )  # fmt: skip
    for n, r in runs.items():
        for i, phase in enumerate(PHASES):
            row = r[phase]
            s, req = row.get("s"), row.get("requests")
            table.add_row(
                str(n) if i == 0 else "", phase,
                "-" if s is None else f"{s:.3f}", "-" if req is None else f"{req:,.0f}",
                row["how"], row.get("note", ""),
            )  # fmt: skip
    grow = new_table(
        "Growth: k in value ~ ranks^k (least squares on log-log over the measured sizes)",
        f"faster than n log n: k above {NLOGN_SLOPE} (n log n's slope is about 1.14 here); "
        "the metadata phases' times are one rank's: k = 1 there would be n x n work over "
        "the job; rank 0's plan of the whole save is O(n) once",
        [("phase", "left"), ("k (time)", "right"), ("k (requests)", "right"),
         ("faster than n log n", "left")],
    )  # fmt: skip
    for phase, g in growth.items():
        ks = [g[w] for w in ("s", "requests") if g[w] is not None]
        grow.add_row(
            phase, *("-" if g[w] is None else f"{g[w]:.2f}" for w in ("s", "requests")),
            "yes" if any(k > NLOGN_SLOPE for k in ks) else "no",
        )  # fmt: skip
        if (k := g.get("beside")) is not None:
            grow.add_row(f"{phase}: {BESIDE[phase][0]}", f"{k:.2f}", "-",
                         "yes" if k > NLOGN_SLOPE else "no")  # fmt: skip
    show(160, table, grow)


def plot(runs: Runs, path: str) -> None:
    """Phase time against ranks, log-log: measured points filled, projected hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for phase in PHASES:
        pts = [(n, r[phase]) for n, r in runs.items() if (r[phase].get("s") or 0) > 0]
        (line,) = ax.plot([n for n, _ in pts], [p["s"] for _, p in pts], "-", label=phase)
        for n, p in pts:
            filled = p["how"] == "measured"
            ax.plot(n, p["s"], "o", color=line.get_color(),
                    markerfacecolor=line.get_color() if filled else "none")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="ranks (8 per node)", ylabel="seconds",
           title="unbroken's control plane on the scale harness (hollow: projected)")  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default=",".join(map(str, SIZES)), help="world sizes")
    parser.add_argument("--tensors", type=int, default=100, help="per rank, for the save")
    parser.add_argument("--protocol-max", type=int, default=max(SIZES),
                        help="largest size the recovery protocol runs at (larger: "
                        "projected)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help=f"CI: {SMOKE}, 10 tensors")
    parser.add_argument("--plot", metavar="PNG", help="phase time against ranks, log-log")
    args = parser.parse_args()
    sizes = list(SMOKE) if args.smoke else [int(n) for n in args.ranks.split(",")]
    tensors = 10 if args.smoke else args.tensors
    if args.smoke:  # two host processes at 64 ranks: the harness's hand-offs between them
        scale_hosts.HOST_RANKS = 32
    if any(n < 16 or n % 8 for n in sizes) or tensors < 1:
        parser.error("--ranks: multiples of 8 (ranks per node), at least 16")
    started = time.monotonic()
    runs = {n: measure(n, tensors, args.protocol_max) for n in sorted(sizes)}
    growth = fit(runs)
    report(runs, growth)
    if args.plot:
        plot(runs, args.plot)
    print_result({
        "ranks_per_node": scale_protocol.LOCAL, "tensors": tensors, "phases": list(PHASES),
        "runs": {str(n): r for n, r in runs.items()},
        "growth": growth, "nlogn_slope": NLOGN_SLOPE,
        "wall_s": round(time.monotonic() - started, 1),
    })  # fmt: skip


if __name__ == "__main__":
    main()
