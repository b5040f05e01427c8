"""Job time under a storm of failures: one job, one seeded fault schedule, every method.

    python bench/storm.py                       # a fault every 30 s; --every, --steps, --seed
    python bench/storm.py --quick               # the CI smoke: a short job, (e) and (c)
    python bench/storm.py --plot storm.png      # the methods' timelines, one above the other

The job (bench/storm_job.py): a tiny transformers Llama, DDP on gloo over 2 nodes x 2
ranks on this host (separate process trees, each node its own shared memory), data
through ``unbroken.data``. The storm (bench/storm_faults.py): process crashes, node losses
(rank 0's among them) and one hang, the same moments for every method, counted from its
first step. The methods: (e) the reference, no fault and no checkpoint, run first; (a)
torchrun + DCP ``async_save`` every K steps, K from Young/Daly for the DCP stall and step
time (e) measured; (b) ``unbroken run`` restarting every worker, from memory; (c) ``unbroken
run --in-process``: live healing, warm spares, a standby node; (d) torchft
(bench/storm_torchft.py). A lost node ends the whole job of (a) and (b) until its
replacement arrives, as a scheduler restarts a torchrun job (bench/storm_launch.py).

Per method: wall time, goodput and badput by cause (bench/storm_report.py, the same
accounting for all, from the ranks' step events), steps recomputed, and whether the final
parameters and every step's loss are bitwise (e)'s. Ends with ``RESULT {json}``."""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import storm_methods
import storm_report
import storm_sim
import storm_torchft
from common import new_table, print_result, show
from storm_faults import Run, drive, schedule
from storm_launch import Config, Launch

TARGET_KEEP = 0.95  # (c)'s share of (e)'s throughput


def young_daly(stall_s: float, mtbf_s: float, step_s: float) -> int:
    """Steps between saves: sqrt(2 x stall x MTBF) of training."""
    return max(1, round(math.sqrt(2 * stall_s * mtbf_s) / step_s))


def measure(run: Run, reference: list[dict[str, Any]] | None, save_every: int = 0) -> dict:
    events = storm_report.read(run.out)
    result: dict[str, Any] = {"key": run.launch.key, "label": run.launch.label}
    if run.failed:
        return result | {"failed": run.failed, "faults": [f["kind"] for f in run.faults]}
    result |= storm_report.account(events, run.faults, run.t0)
    result["faults"] = [f["kind"] for f in run.faults]
    if reference is not None:
        result |= storm_report.compare(events, reference)
    if run.launch.key in storm_sim.INTERVAL:
        predicted = storm_sim.predict(run.launch.key, events, run.faults, result, run.t0,
                                      save_every)  # fmt: skip
        result["predicted_goodput"] = round(predicted, 4)
    result["timeline"] = storm_report.timeline(events, run.t0)
    return result


def methods(cfg: Config, keys: str, save_every: int) -> list[Launch]:
    make = {
        "a": lambda: storm_methods.dcp(cfg, save_every),
        "b": lambda: storm_methods.restart_all(cfg, save_every),
        "c": lambda: storm_methods.in_process(cfg, save_every),
        "d": lambda: storm_torchft.launch(cfg),
    }
    return [make[k]() for k in keys if k in make]


def table(results: list[dict[str, Any]], cfg: Config, save_every: int) -> None:
    causes = storm_report.CAUSES
    t = new_table(
        f"storm: 2 nodes x 2 ranks, tiny Llama, {cfg.steps} steps, a fault every "
        f"{cfg.every:g} s (seed {cfg.seed})",
        f"seconds; badput by cause from the ranks' step events; (a), (b) save every "
        f"{save_every} steps; node replacement after {cfg.replace_delay:g} s; hang timeout "
        f"{cfg.hang_timeout:g} s, (b) and (c) within {cfg.hang_factor:g}x a rank's longest "
        "heartbeat gap; slower: productive time beyond (e)'s mean step, over as many steps",
        [("method", "left"), ("wall", "right"), ("vs (e)", "right"), ("goodput", "right"),
         ("simulated", "right"),
         *((c, "right") for c in causes), ("slower", "right"), ("redone", "right"),
         ("faults", "right"),
         ("bitwise", "left")],
    )  # fmt: skip
    ref = results[0]["wall_s"]
    for r in results:
        if "failed" in r:  # the reason in the last column, as wide as it already is
            blank = [""] * (len(t.columns) - 4)  # all but method, wall, faults, bitwise
            t.add_row(r["label"], "failed", *blank, str(len(r["faults"])), r["failed"])
            continue
        bitwise = "-" if "final_bitwise" not in r else (
            f"params {'yes' if r['final_bitwise'] else 'no'}, losses "
            f"{r['losses_compared'] - r['losses_differing']}/{r['losses_in_reference']}"
        )  # fmt: skip
        t.add_row(
            r["label"], f"{r['wall_s']:.1f}", f"{ref / r['wall_s']:.1%}", f"{r['goodput']:.1%}",
            f"{r['predicted_goodput']:.1%}" if "predicted_goodput" in r else "-",
            *(f"{r['badput_s'][c]:.1f}" for c in causes),
            f"{r['slower_s']:.1f}", str(r["steps_recomputed"]),
            str(len(r["faults"])), bitwise,
        )  # fmt: skip
    show(200, t)


def plot(results: list[dict[str, Any]], runs: list[Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, sharex=True, figsize=(10, 1.8 * len(results)))
    colours = {"crash": "tab:red", "node": "tab:purple", "hang": "tab:orange"}
    for ax, r, run in zip(axes, results, runs, strict=True):
        if "failed" in r:
            continue
        xs, ys = zip(*r["timeline"], strict=True)
        ax.plot(xs, ys, ".", markersize=1.5)
        for f in run.faults:
            ax.axvline(f["t"] - run.t0, color=colours[f["kind"]], linewidth=0.8)
        ax.set_ylabel("step")
        ax.set_title(r["label"], fontsize=8, loc="left")
    axes[-1].set_xlabel("seconds since launch (lines: crash red, node purple, hang orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["key"]: r for r in results}
    if "c" not in by:
        return {}
    c, e = by["c"], by["e"]
    if "failed" in c:
        return {"c_failed": c["failed"]}
    rivals = [r.get("wall_s", math.inf) for k, r in by.items() if k in "abd"]
    off = {k: by[k]["goodput"] - by[k]["predicted_goodput"] for k in "abc"
           if k in by and "predicted_goodput" in by[k]}  # fmt: skip
    return {
        "simulated_within_5pp": {k: abs(v) <= 0.05 for k, v in off.items()},
        "c_keeps": round(e["wall_s"] / c["wall_s"], 4),
        "c_keeps_pass": e["wall_s"] / c["wall_s"] >= TARGET_KEEP,
        "c_first": all(c["wall_s"] < w for w in rivals) if rivals else None,
        "c_bitwise": c.get("final_bitwise", False) and c.get("losses_bitwise", False),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", type=int, default=200, help="at most this many faults")
    p.add_argument("--methods", default="abcd", help="which of a, b, c, d besides (e)")
    p.add_argument("--replace-delay", type=float, default=10.0)
    p.add_argument("--hang-timeout", type=float, default=10.0)
    p.add_argument("--hang-factor", type=float, default=5.0, help="(b), (c); 0: the timeout alone")
    p.add_argument("--quick", action="store_true", help="CI: 240 steps, 3 faults 6 s apart, (c)")
    p.add_argument("--plot", help="write the timelines here (PNG)")
    p.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = p.parse_args()
    if args.quick:
        # Steps enough that the third fault lands on the fastest run of this VM seen yet
        # (0.11 s a step for (c)): at 120 steps, faults 8 s apart, (c) once ended before.
        args.steps, args.every, args.faults, args.methods = 240, 6.0, 3, "c"
    if "d" in args.methods and shutil.which("torchft_lighthouse") is None:  # before the others run
        p.error("(d) needs torchft: pip install -e '.[bench]', or leave it out: --methods abc")
    cfg = Config(args.steps, args.every, args.seed, replace_delay=args.replace_delay,
                 hang_timeout=args.hang_timeout, hang_factor=args.hang_factor)  # fmt: skip
    # A SIGTERM unwinds like Ctrl-C, through the `finally` that ends each run's processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    where = Path(tempfile.mkdtemp(prefix="unbroken-storm-"))
    try:
        ref_run = drive(storm_methods.reference(cfg), cfg, where / "e", [], 120 + cfg.steps)
        reference = storm_report.read(ref_run.out)
        runs, results = [ref_run], [measure(ref_run, None)]
        stall = next(e["dcp_stall_s"] for e in reference if e["event"] == "calibrate")
        save_every = young_daly(stall, cfg.every, results[0]["median_step_s"])
        timeout = 120 + 5 * results[0]["wall_s"]  # then a method counts as failed
        for launch in methods(cfg, args.methods, save_every):
            storm = schedule(cfg)[: args.faults]
            runs.append(drive(launch, cfg, where / launch.key, storm, timeout))
            results.append(measure(runs[-1], reference, save_every))
    finally:
        if not args.keep:
            shutil.rmtree(where, ignore_errors=True)
    for r in results:
        if "productive" in r:
            r["slower_s"] = round(storm_report.slower(r, results[0]), 2)
    table(results, cfg, save_every)
    if args.plot:
        plot(results, runs, args.plot)
    checks = targets(results)
    for name, value in checks.items():
        print(f"target {name}: {value}")
    for r in results:
        r.pop("timeline", None)
    print_result({"methods": results, "targets": checks, "save_every": save_every,
                  "dcp_stall_s": stall, "config": vars(args)})  # fmt: skip


if __name__ == "__main__":
    main()
