"""The table, the verdicts and the RESULT json of bench/recovery.py."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from common import new_table, show
from recovery_scaling import growth
from recovery_scenarios import LATE_S, PHASES, RecoveryConfig

TARGET_REDUCTION = 0.85  # at least 85 % less time than (a)
SILENT_TARGET_S = 2.0  # (i): a stopped node -> every rank stepped again, no step lost


def report(
    cfg: RecoveryConfig,
    results: dict[str, dict[str, Any]],
    scaling: list[dict[str, Any]],
    wall: float,
) -> dict[str, Any]:
    """Print the table and the verdicts; return the RESULT json."""
    base = results["a"]["total_s"] if "a" in results else None
    for r in results.values():
        done = base is not None and r["total_s"] is not None
        r["reduction_vs_a"] = round(1 - r["total_s"] / base, 4) if done else None
    print_table(cfg, results, scaling)
    time_pass: dict[str, bool] = {}
    verdict = time_verdicts(results, base, time_pass)
    lost_pass, lines = lost_verdict(cfg, results)
    verdict += lines
    silent_pass = None
    if "i" in results:
        silent_pass, line = silent_verdict(results["i"])
        verdict.append(line)
    late_pass = None
    if "k" in results:
        late_pass, line = late_verdict(results["k"])
        verdict.append(line)
    if not any(r["in_process"] and r["total_s"] is not None for r in results.values()):
        verdict.append(
            "no in-process recovery completed: every measured recovery restarted all workers"
        )
    k_init = growth(scaling, "reinit_median_s")
    k_group = growth(scaling, "new_group_median_s")
    if scaling:
        verdict.append(scaling_verdict(scaling, k_init, k_group))
    for line in verdict:
        print(line)
    return {
        "config": asdict(cfg) | {"ranks": cfg.ranks, "steps": cfg.steps},
        "checkpoint": "unbroken.Checkpointer, synchronous save (fsync), replicated_reads='each'",
        "scenarios": results,
        "targets": {
            "reduction_vs_a": TARGET_REDUCTION,
            "lost_steps_max": cfg.memory_every,
            "silent_total_s_max": SILENT_TARGET_S,
        },
        "pass": {
            "time": time_pass,
            "lost_work": lost_pass,
            "silent": silent_pass,
            "late_replacement": late_pass,
        },
        "scaling": scaling,
        "scaling_exponent": {"pg_reinit": k_init, "new_group": k_group},
        "wall_s": round(wall, 1),
    }


def silent_verdict(r: dict[str, Any]) -> tuple[bool, str]:
    """(i)'s target: whether it passed, and its line."""
    what = f"target (i) a stopped node: next step <= {SILENT_TARGET_S:g} s, 0 steps lost"
    if r["total_s"] is None:
        return False, f"{what}: FAIL (no recovery: {r['failed']})"
    ok = r["total_s"] <= SILENT_TARGET_S and r["lost_steps"] == 0
    return ok, f"{what}: {'PASS' if ok else 'FAIL'} ({r['total_s']:.2f} s, {r['lost_steps']} lost)"


def lost_verdict(
    cfg: RecoveryConfig, results: dict[str, dict[str, Any]]
) -> tuple[dict[str, bool], list[str]]:
    """The lost-work target: whether each scenario but (a) met it, and its line."""
    lost_pass = {
        k: r["lost_steps"] is not None and r["lost_steps"] <= cfg.memory_every
        for k, r in results.items()
        if k != "a"
    }
    if not lost_pass:
        return lost_pass, []
    counts = {k: results[k]["lost_steps"] for k in lost_pass}
    lost = ", ".join(f"({k}) {'no recovery' if n is None else n}" for k, n in counts.items())
    return lost_pass, [
        f"target lost work <= memory snapshot interval ({cfg.memory_every} step(s)): "
        f"{'PASS' if all(lost_pass.values()) else 'FAIL'} ({lost}"
        + (f"; (a) {results['a']['lost_steps']})" if "a" in results else ")")
    ]


def late_verdict(r: dict[str, Any]) -> tuple[bool, str]:
    """(k)'s target: the survivors wait for a late replacement, never restarted."""
    what = f"target (k) a replacement after {LATE_S:g} s: no survivor restarted, 0 steps lost"
    if r["total_s"] is None:
        return False, f"{what}: FAIL (no recovery: {r['failed']})"
    ok = r["survivors_restarted"] == 0 and r["lost_steps"] == 0
    return ok, (
        f"{what}: {'PASS' if ok else 'FAIL'} ({r['total_s']:.2f} s, {r['lost_steps']} lost, "
        f"{r['survivors_restarted']} survivors restarted)"
    )


def time_verdicts(
    results: dict[str, dict[str, Any]], base: float | None, time_pass: dict[str, bool]
) -> list[str]:
    """The time target's lines; whether each target scenario passed goes into
    ``time_pass``."""
    verdict = []
    for key in ("c", "f", "g"):  # the targets; (d) and (e) are shown for comparison
        if base is None or key not in results:
            continue
        r = results[key]
        reduction = r["reduction_vs_a"]
        if reduction is None:
            time_pass[key] = False
            verdict.append(
                f"target ({key}) at least {TARGET_REDUCTION:.0%} less time than (a): FAIL "
                f"(no recovery: {r['failed']})"
            )
            continue
        time_pass[key] = reduction >= TARGET_REDUCTION
        verdict.append(
            f"target ({key}) at least {TARGET_REDUCTION:.0%} less time than (a): "
            f"{'PASS' if time_pass[key] else 'FAIL'} ({r['total_s']:.2f} s against "
            f"{base:.2f} s: {abs(reduction):.1%} {'less' if reduction >= 0 else 'more'})"
        )
    return verdict


def scaling_verdict(
    scaling: list[dict[str, Any]], k_init: float | None, k_group: float | None
) -> str:
    sizes = ", ".join(f"{s['ranks']}: {s['reinit_median_s'] * 1e3:.1f} ms" for s in scaling)
    groups = ", ".join(f"{s['ranks']}: {s['new_group_median_s'] * 1e3:.0f} ms" for s in scaling)
    return (
        f"process-group re-init by ranks (gloo, tiny state, median): default group {sizes}"
        + ("" if k_init is None else f" (about ranks^{k_init:.2f})")
        + f"; Checkpointer group (new_group) {groups}"
        + ("" if k_group is None else f" (about ranks^{k_group:.2f})")
        + f"; this host has {os.cpu_count()} cores, so larger worlds also share CPUs"
    )


def print_table(
    cfg: RecoveryConfig, results: dict[str, dict[str, Any]], scaling: list[dict[str, Any]]
) -> None:
    table = new_table(
        f"recovery: {cfg.nodes} simulated nodes x {cfg.nproc_per_node} ranks, "
        f"{cfg.mib_per_rank:g} MiB state per rank, CPU/gloo; disk checkpoint every "
        f"{cfg.save_every} steps, fault at step {cfg.fault_step}",
        "seconds, slowest rank at each phase boundary; total = fault -> every rank "
        f"completed a step again; back at step {cfg.fault_step}: lost steps redone too; "
        "procs: worker processes started anew ((a), (b), (d): torchrun restarts every worker; "
        "(c), (e): unbroken run --in-process replaces the lost ones only); step, snapshot: "
        "steady-state medians per rank before the fault. Process groups only: re-init of the "
        "default gloo group (PG init) and of a Checkpointer's group, new_group (setup), "
        f"median of {cfg.scaling_repeats - 1} rounds",
        [
            ("scenario", "left"),
            *((title, "right") for _, title in PHASES),
            ("total", "right"),
            (f"back at step {cfg.fault_step}", "right"),
            ("restored from", "left"),
            ("lost steps", "right"),
            ("procs", "right"),
            ("step", "right"),
            ("snapshot", "right"),
        ],
    )
    keys = list(results)
    for key in keys:
        table.add_row(
            *scenario_cells(results[key], key, len(table.columns)), end_section=key == keys[-1]
        )
    names = [k for k, _ in PHASES]
    for s in scaling:
        cells = [""] * len(PHASES)
        cells[names.index("pg_init")] = f"{s['reinit_median_s']:.3f}"
        cells[names.index("setup")] = f"{s['new_group_median_s']:.3f}"
        table.add_row(
            f"process groups only, {s['ranks']} tiny ranks",
            *cells,
            *[""] * (len(table.columns) - 1 - len(cells)),
        )
    show(200, table)


def scenario_cells(r: dict[str, Any], key: str, columns: int) -> list[str]:
    """A scenario's row: its phases, total, where it restored from and its costs."""
    if r["total_s"] is None:
        cells = ["-"] * len(PHASES) + ["no recovery", "-", r["failed"]]
        cells += ["-"] * (columns - 1 - len(cells))
        return [r["short"], *cells]
    total = f"{r['total_s']:.2f}"
    if r["reduction_vs_a"] is not None and key != "a":
        total += f" ({-r['reduction_vs_a']:+.0%})"
    source = r["restored_from"].replace("shared memory", "memory")
    source = source.replace(", peer replicas for ranks", " + replicas for") + " @ "
    source += str(r["restored_step"])
    if r["cold_cache_resident"] is not None:
        source += f" ({r['cold_cache_resident']:.0%} cached)"
    return [
        r["short"],
        *_seconds_each(r["phases_s"].get(k) for k, _ in PHASES),
        total,
        f"{r['back_at_fault_step_s']:.2f}",
        source,
        str(r["lost_steps"]),
        str(r["processes_restarted"])
        + (f" ({r['warm_spares_used']} spares)" if r["warm_spares_used"] else ""),
        _seconds(r["step_s"]),
        _seconds(r["snapshot_s"]),
    ]


def _seconds_each(values: Any) -> list[str]:
    return [_seconds(v) for v in values]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
