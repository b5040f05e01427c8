"""``unbroken simulate``: project goodput and recovery time at cluster scale,
traditional restart-from-storage and checkpointless side by side.

    unbroken simulate --gpus 2304 --gpu-mtbf-hours 50000 --state-gb-per-gpu 10

Each of `unbroken.goodput.costs.Cluster`'s fields is an option (``--nic-gbps``,
``--store-gbps``, ``--mix 0.5,0.4,0.1``...). Process-level costs come from this
machine's bench/recovery.py figures (README), or ``--results FILE`` of its ``RESULT``
lines. The checkpoint interval is the one `unbroken.policies.young_daly` picks for each
strategy's stall and the job's MTBF, unless ``--interval`` is given; ``--plot PNG`` draws
goodput against the interval with that choice marked. Method and validation:
docs/simulation.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from unbroken.goodput.costs import KINDS, Cluster, Costs, Measured, from_results, strategy_costs
from unbroken.goodput.simulate import simulate
from unbroken.policies import young_daly

STRATEGIES = ("traditional", "checkpointless")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="unbroken simulate", description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Cluster):
        name = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "mix":
            p.add_argument(name, default="0.5,0.4,0.1", help="process,node,hang shares")
        else:
            kind = int if f.type == "int" else float
            p.add_argument(name, type=kind, default=f.default, help=f"default {f.default}")
    p.add_argument("--strategy", choices=[*STRATEGIES, "both"], default="both")
    p.add_argument("--interval", type=float, help="checkpoint interval, seconds of training")
    p.add_argument("--days", type=float, default=30.0, help="simulated time (30)")
    p.add_argument("--seeds", type=int, default=5, help="runs averaged (5)")
    p.add_argument("--results", type=Path, help="bench/recovery.py output (RESULT line)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--plot", type=Path, metavar="PNG", help="goodput against the interval")
    return p.parse_args(argv)


# Fields a projection divides by, or a cluster cannot have none of: above zero. The
# others (timeouts, warm-ups) may be zero, never negative.
POSITIVE = {"gpus", "gpus_per_node", "gpu_mtbf_hours", "d2h_gbps", "nic_gbps", "store_gbps"}
POSITIVE |= {"step_s"}


def cluster_of(args: argparse.Namespace) -> Cluster:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Cluster)}
    try:
        mix = tuple(float(x) for x in str(args.mix).split(","))
    except ValueError:
        mix = ()
    if len(mix) != 3 or not all(math.isfinite(x) and x >= 0 for x in mix) or sum(mix) <= 0:
        raise SystemExit(
            f"unbroken simulate: --mix {args.mix}: three shares of failures, process,node,hang "
            "(e.g. 0.5,0.4,0.1)"
        )
    for name, value in values.items():
        if name == "mix" or isinstance(value, bool):
            continue
        least = "above 0" if name in POSITIVE else "0 or more"
        if not math.isfinite(value) or value < 0 or (value == 0 and name in POSITIVE):
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"unbroken simulate: {flag} {value}: give a number {least}")
    return Cluster(**{**values, "mix": (mix[0], mix[1], mix[2])})


def _check_run(args: argparse.Namespace) -> None:
    """The options that are not the cluster's: what a run of the simulation needs."""
    if not (math.isfinite(args.days) and args.days > 0):
        raise SystemExit(f"unbroken simulate: --days {args.days}: give a number above 0")
    if args.seeds < 1:
        raise SystemExit(f"unbroken simulate: --seeds {args.seeds}: give at least 1")
    if args.interval is not None and not (math.isfinite(args.interval) and args.interval > 0):
        raise SystemExit(f"unbroken simulate: --interval {args.interval}: seconds, above 0")


def measured_of(path: Path | None) -> dict[str, Measured]:
    """The phases ``--results`` names, or none; a file that holds none is a usage error."""
    if path is None:
        return {}
    try:
        return from_results(path)
    except OSError as e:
        raise SystemExit(f"unbroken simulate: --results {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"no {e} in its RESULT line" if isinstance(e, KeyError) else str(e)
        raise SystemExit(
            f"unbroken simulate: --results {path}: not the output of bench/recovery.py "
            f"({why}); give the file its RESULT line is in, or leave --results out"
        ) from None


def project(
    costs: Costs, cluster: Cluster, interval: float | None, days: float, seeds: int
) -> dict[str, Any]:
    """One strategy's projection: the mean over ``seeds`` runs."""
    chosen = young_daly(costs.stall, cluster.mtbf_s)
    every = interval if interval is not None else chosen
    runs = [
        simulate(costs, every, cluster.mtbf_s, days * 86400, cluster.mix, seed=s)
        for s in range(seeds)
    ]
    seconds = {k: statistics.fmean(r.seconds[k] for r in runs) for k in runs[0].seconds}
    wall = sum(seconds.values())
    recoveries = [x for r in runs for x in r.recoveries]
    return {
        "strategy": costs.strategy,
        "interval_s": round(every, 1),
        "young_daly_s": round(chosen, 1),
        "goodput": round(statistics.fmean(r.goodput for r in runs), 5),
        "badput": {k: round(v / wall, 5) for k, v in seconds.items() if k != "productive"},
        "failures_per_day": round(statistics.fmean(r.failures for r in runs) / days, 2),
        "recovery_s": {k: round(costs.recovery_s(k), 1) for k in KINDS},
        "recovery_mean_s": round(statistics.fmean(recoveries), 1) if recoveries else None,
        "checkpoint_stall_s": round(costs.stall, 2),
    }


def table(cluster: Cluster, rows: list[dict[str, Any]]) -> str:
    head = (
        f"{cluster.gpus} GPUs, GPU MTBF {cluster.gpu_mtbf_hours:g} h (job: one failure "
        f"every {cluster.mtbf_s / 3600:.2f} h), {cluster.state_gb_per_gpu:g} GB/GPU"
    )
    lines = [head, f"  {'':<28}" + "".join(f"{r['strategy']:>16}" for r in rows)]

    def row(what: str, cells: list[str]) -> None:
        lines.append(f"  {what:<28}" + "".join(f"{c:>16}" for c in cells))

    row("goodput", [f"{100 * r['goodput']:.2f} %" for r in rows])
    row("checkpoint interval (s)", [f"{r['interval_s']:g}" for r in rows])
    row("  young_daly would pick (s)", [f"{r['young_daly_s']:g}" for r in rows])
    row("stall per checkpoint (s)", [f"{r['checkpoint_stall_s']:g}" for r in rows])
    for kind in KINDS:
        row(f"recovery, {kind} failure (s)", [f"{r['recovery_s'][kind]:g}" for r in rows])
    row("failures per day", [f"{r['failures_per_day']:g}" for r in rows])
    for cause in rows[0]["badput"]:
        row(f"badput: {cause}", [f"{100 * r['badput'][cause]:.2f} %" for r in rows])
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cluster = cluster_of(args)
    _check_run(args)
    measured = measured_of(args.results)
    chosen = STRATEGIES if args.strategy == "both" else (args.strategy,)
    costs = [strategy_costs(s, cluster, measured.get(s)) for s in chosen]
    rows = [project(c, cluster, args.interval, args.days, args.seeds) for c in costs]
    if args.json:
        print(json.dumps({"cluster": dataclasses.asdict(cluster), "strategies": rows}))
    else:
        print(table(cluster, rows), flush=True)
    if args.plot is not None:
        from unbroken.goodput.simulate_plot import plot

        plot(args.plot, cluster, costs, args.days, min(args.seeds, 3))
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
