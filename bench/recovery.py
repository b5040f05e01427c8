"""Recovery after a fault: time from the fault to the first completed step after it, and
the steps lost, for a traditional restart from disk against unbroken's memory tiers and
in-process recovery, each phase timed; then how process-group (re-)initialisation grows
with the number of ranks.

    python bench/recovery.py                      # 2 simulated nodes x 2 ranks, 256 MiB/rank
    python bench/recovery.py --mib-per-rank 16    # smoke, under 2 minutes
    python bench/recovery.py --scenarios ace      # a subset

Every scenario is one real job under ``unbroken run --simulate-nodes`` (each node with its
own shared-memory directory), on CPU with gloo. Each rank trains bench/recovery_worker.py:
8 large "expert" Linear layers (one per step, round robin) around a small trunk and head,
each part its own DDP, AdamW; parameters plus optimizer state come to --mib-per-rank on
every rank. Every scenario saves a disk checkpoint every --save-every steps with
``unbroken.Checkpointer`` (synchronous, fsynced) and injects its fault at --fault-step,
between two disk checkpoints:

(a) traditional: ``kill rank=1``; torchrun restarts every worker, which reload the last
    disk checkpoint (Checkpointer without memory) with a cold page cache: each restarted
    rank evicts the checkpoint's files (``posix_fadvise(DONTNEED)``, residency checked with
    ``mincore``) before any rank reads, then a barrier;
(b) same fault; snapshots in node-local shared memory every --memory-every steps; torchrun
    restarts every worker, which restore from their own node's memory;
(c) ``kill-node node=1`` (its ranks and its shared memory) under ``unbroken run
    --in-process --warm-spare``; snapshots also replicated to a peer on the other node
    (replicas=1): the healthy ranks keep their processes, abort their process groups and
    roll back from their own memory; standby processes (torch already imported) take the
    lost node's ranks and pull their state from the replicas. The target is for this one;
(d) the same node loss with unbroken's fallback: a replacement node joins, torchrun
    restarts every worker, the lost node's ranks restore from their peers' replicas;
(e) as (c) without warm spares: the lost node's ranks start as new interpreters.

Phases, from the launcher's timeline (``--timeline-json``) and the workers' own event
logs, each boundary the moment the last rank passed it: detect (fault -> the launcher sees
the exit or the node loss), restart (-> the new worker processes started: torchrun stops
the survivors and re-rendezvous, or the supervisor respawns the lost ranks), startup (->
every rank entered process-group init: interpreter and imports for new processes),
PG init (-> ``init_process_group`` done), setup (-> Checkpointer and its group built;
plus the cache eviction in (a)), restore, first step (-> DDP wrappers built and every
rank completed a step); total = fault -> first step.
Lost steps: completed steps that had to be redone; "back at step N": fault -> every rank
has completed the fault step again. Step and snapshot: steady-state medians per rank
before the fault (training step with its all-reduce; time the loop waits in ``snapshot``).
A job that does not recover (the hang watchdog, --heartbeat-timeout, kills ranks that make
no progress; --max-restarts 2) is reported as such, with the launcher's reasons.

Scaling: for each world size in --scaling-ranks, that many forked processes (no state,
no interpreter start) connect to one TCPStore, then initialise the default gloo group and
a Checkpointer-style ``new_group`` --scaling-repeats times, each round on a fresh key
prefix, as a recovery that keeps its processes would. Times run from the last rank to
start to the last rank to finish; round 0 includes connecting to the store.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

from save_load import free_port, on_tmpfs
from unbroken.launcher import SIM_MEMORY_ROOT

WORKER = Path(__file__).with_name("recovery_worker.py")
TARGET_REDUCTION = 0.85  # at least 85 % less time than (a)
JOB_TIMEOUT_S = 300.0
PHASES = [
    ("detect", "detect"),
    ("restart", "restart"),
    ("startup", "startup"),
    ("pg_init", "PG init"),
    ("setup", "setup"),
    ("restore", "restore"),
    ("first_step", "first step"),
]


@dataclass(frozen=True)
class Config:
    nodes: int
    nproc_per_node: int
    mib_per_rank: float
    save_every: int
    fault_step: int
    memory_every: int
    steps_after: int
    heartbeat_timeout: float
    scaling_ranks: tuple[int, ...]
    scaling_repeats: int
    dir: str

    @property
    def ranks(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def steps(self) -> int:
        return self.fault_step + self.steps_after


@dataclass(frozen=True)
class Scenario:
    key: str
    short: str  # for the table
    label: str
    fault: str
    memory_every: int
    replicas: int
    cold: bool = False
    launcher: tuple[str, ...] = ()  # options of `unbroken run` beyond the common ones

    @property
    def in_process(self) -> bool:
        return "--in-process" in self.launcher


def scenarios(cfg: Config) -> list[Scenario]:
    kill = f"kill rank=1 step={cfg.fault_step}"
    node = f"kill-node node={cfg.nodes - 1} step={cfg.fault_step}"
    every = cfg.memory_every
    return [
        Scenario(
            "a",
            "(a) traditional: restart all, last disk checkpoint, cold cache",
            "(a) traditional: restart all workers, reload the last disk checkpoint, cold cache",
            kill,
            memory_every=0,
            replicas=0,
            cold=True,
        ),
        Scenario(
            "b",
            "(b) restart all, own shared memory",
            "(b) unbroken: restart all workers, restore from own shared memory",
            kill,
            memory_every=every,
            replicas=0,
        ),
        Scenario(
            "c",
            "(c) node lost: in-process, warm spares",
            "(c) unbroken: node lost, in-process recovery (healthy ranks stay up and roll back "
            "from their own memory; warm spares take the lost node's ranks and pull their "
            "state from peer replicas)",
            node,
            memory_every=every,
            replicas=1,
            launcher=("--in-process", "--warm-spare"),
        ),
        Scenario(
            "d",
            "(d) node lost: restart all, peer replicas",
            "(d) unbroken's fallback: node lost, restart all workers, restore from own memory "
            "+ peer replicas",
            node,
            memory_every=every,
            replicas=1,
        ),
        Scenario(
            "e",
            "(e) node lost: in-process, cold replacements",
            "(e) as (c) without warm spares: the lost node's ranks start as new processes",
            node,
            memory_every=every,
            replicas=1,
            launcher=("--in-process",),
        ),
    ]


# --------------------------------------------------------------------------- running


class JobFailed(RuntimeError):
    """A scenario's job did not recover or finish: ``why`` in a line, and its log's tail."""

    def __init__(self, why: str, tail: str = "", details: list[str] | None = None) -> None:
        super().__init__(why)
        self.why, self.tail, self.details = why, tail, details or []


def launch(options: list[str], worker_args: list[str], where: Path, timeout: float) -> None:
    """``python -m unbroken run OPTIONS recovery_worker.py ARGS``, output into a log file;
    JobFailed, with the launcher's reasons, if the job fails."""
    log = where / "launcher.log"
    cmd = [sys.executable, "-m", "unbroken", "run", *options, str(WORKER), *worker_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
    if code is None or code.returncode != 0:
        lines = log.read_text(errors="replace").splitlines()
        said = [line.split("] ", 1)[-1] for line in lines if line.startswith("unbroken run: [")]
        hung = [line for line in said if "made no progress" in line]
        gave_up = [line for line in said if "used up" in line or "cannot be replaced" in line]
        why = f"timed out after {timeout:g} s" if code is None else f"exited {code.returncode}"
        if hung:
            why = f"hung after the fault; the watchdog killed {len(hung)} rank(s)"
        if gave_up:
            why += "; out of restarts"
        details = [line for line in said if "made no progress" in line or "used up" in line]
        raise JobFailed(why, "\n".join(lines[-40:]), details)


def read_events(folder: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(folder.glob("events-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    return events


def run_scenario(cfg: Config, sc: Scenario) -> dict[str, Any]:
    where = Path(cfg.dir) / sc.key
    out = where / "events"
    out.mkdir(parents=True)
    timeline_path = where / "timeline.json"
    options = [
        f"--simulate-nodes={cfg.nodes}",
        f"--nproc-per-node={cfg.nproc_per_node}",
        "--max-restarts=2",
        "--monitor-interval=0.1",
        f"--heartbeat-timeout={cfg.heartbeat_timeout:g}",
        f"--timeline-json={timeline_path}",
        f"--inject-fault={sc.fault}",
        *sc.launcher,
    ]
    worker_args = [
        f"--out={out}",
        f"--ckpt={where / 'ckpt'}",
        f"--steps={cfg.steps}",
        f"--save-every={cfg.save_every}",
        f"--memory-every={sc.memory_every}",
        f"--replicas={sc.replicas}",
        f"--mib-per-rank={cfg.mib_per_rank}",
        *(["--cold"] if sc.cold else []),
    ]
    started = time.monotonic()
    try:
        launch(options, worker_args, where, timeout=JOB_TIMEOUT_S)
        result = analyse(cfg, sc, json.loads(timeline_path.read_text()), read_events(out))
    except JobFailed as e:
        print(f"  FAILED: {e.why}\n" + textwrap.indent(e.tail, "    | "), flush=True)
        timeline = json.loads(timeline_path.read_text()) if timeline_path.exists() else {}
        result = {
            "short": sc.short,
            "label": sc.label,
            "fault": sc.fault,
            "in_process": sc.in_process,
            "launcher_options": list(sc.launcher),
            "failed": e.why,
            "failure_details": e.details,
            "total_s": None,
            "lost_steps": None,
            "timeline_recoveries": timeline.get("recoveries"),
        }
    result["job_wall_s"] = round(time.monotonic() - started, 2)
    shutil.rmtree(where, ignore_errors=True)  # the checkpoints: 256 MiB per disk save
    return result


def analyse(
    cfg: Config, sc: Scenario, timeline: dict[str, Any], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """The phases of the one recovery in ``timeline``, each boundary the moment the last
    rank passed it (seconds since launch). Every rank passes each boundary once after the
    fault, whether its process is new (a restart) or kept (in-process recovery)."""
    recoveries = timeline["recoveries"]
    if len(recoveries) != 1 or recoveries[0].get("recovery_s") is None:
        raise JobFailed(f"expected one completed recovery, the timeline has {recoveries}")
    rec = recoveries[0]
    fault = rec["fault_t"]
    tl = [e for e in timeline["events"] if e["t"] > fault]
    t0 = timeline["t0"]
    mine = [e | {"t": e["t"] - t0} for e in events if e["t"] - t0 > fault]

    def last(name: str, source: list[dict[str, Any]], count: int = cfg.ranks) -> float:
        times = [e["t"] for e in source if e["event"] == name]
        if len(times) != count:
            raise JobFailed(f"{len(times)} {name!r} events after the fault, not {count}")
        return float(max(times))

    if sc.in_process:  # the supervisor respawned the lost ranks only
        lost = len(rec["respawned"])
        spawned = last("respawn", tl, lost)
    else:  # torchrun restarted every worker
        starts = [e.get("process_start") or e["t"] for e in tl if e["event"] == "process_start"]
        if len(starts) != cfg.ranks:
            raise JobFailed(f"{len(starts)} workers started after the fault, not {cfg.ranks}")
        spawned = max(starts)
    bounds = [
        fault,
        rec["detected_t"],
        spawned,
        last("init_start", tl),
        last("init_done", tl),
        last("restore_start", mine),
        last("restore_end", mine),
        rec["first_step_t"],
    ]
    back = last("step_done", [e for e in mine if e.get("step") == rec["fault_step"]])
    steps = zip(PHASES, pairwise(bounds), strict=True)
    phases = {key: round(b - a, 3) for (key, _), (a, b) in steps}
    ends = [e for e in mine if e["event"] == "restore_end"]
    restored = {e["restored"] for e in ends}
    sources = sorted({str(e["source"]) for e in ends})
    if len(restored) != 1:
        raise JobFailed(f"ranks restored different steps: {sorted(map(str, restored))}")
    (restored_step,) = restored
    # Steady state before the fault: every rank's figures at the first disk save.
    stats = [e for e in events if e["event"] == "stats" and e["t"] - t0 < fault]
    first = [e for e in events if e["event"] == "loss" and e["step"] == 1]
    done = [e for e in events if e["event"] == "done"]
    resident = [e["resident"] for e in ends if e["resident"] is not None]
    sizes = [e["state_mib"] for e in events if e["event"] == "setup_done"]
    return {
        "short": sc.short,
        "label": sc.label,
        "fault": rec["fault"],
        "fault_step": rec["fault_step"],
        "detected_by": rec["detected_by"],
        "memory_every": sc.memory_every,
        "replicas": sc.replicas,
        "in_process": sc.in_process,
        "launcher_options": list(sc.launcher),
        "state_mib_per_rank": round(max(sizes), 1),
        "processes_restarted": len(rec["respawned"]) if sc.in_process else cfg.ranks,
        "warm_spares_used": rec.get("warm_spares", 0),
        "phases_s": phases,
        "total_s": round(rec["recovery_s"], 3),
        "back_at_fault_step_s": round(back - fault, 3),
        "restored_step": restored_step,
        "restored_from": "+".join(sources),
        "lost_steps": rec["steps_redone"],
        "cold_cache_resident": max(resident) if resident else None,
        "evict_s": round(max(e["evict_s"] for e in ends), 4),
        "step_s": _median(e["step_s"] for e in stats),
        "snapshot_s": _median(e["snapshot_s"] for e in stats),
        "disk_save_s": _median(e["save_s"] for e in stats),
        "loss_step_1": _median(e["loss"] for e in first),
        f"loss_step_{cfg.steps}": _median(e["loss"] for e in done),
    }


def _median(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def pg_rank(rank: int, world: int, port: int, repeats: int, results: Any) -> None:
    """One rank of the process-group measurement (a forked child: no interpreter start or
    imports to pay). Round 0 connects to the store first, as a restarted process must."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    connect = time.time()
    store = dist.TCPStore(
        "127.0.0.1", port, world_size=world, is_master=rank == 0, timeout=timeout,
        wait_for_workers=False,
    )  # fmt: skip
    rounds = []
    for i in range(repeats):
        started = time.time()
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"round-{i}", store), rank=rank, world_size=world,
            timeout=timeout,
        )  # fmt: skip
        dist.barrier()
        ready = time.time()
        group = dist.new_group(backend="gloo", timeout=timeout)  # what a Checkpointer does
        dist.barrier(group=group)
        rounds.append((started, ready, time.time()))
        dist.destroy_process_group()
    results.put((rank, connect, rounds))


def run_scaling(cfg: Config, ranks: int) -> dict[str, Any]:
    """Initialise the default gloo group, then a Checkpointer-style ``new_group``, in
    ``ranks`` processes, --scaling-repeats times on one store with a fresh key prefix per
    round (as a recovery that keeps its processes would). Each time is from the last rank
    to start to the last rank to finish."""
    ctx = mp.get_context("fork")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=pg_rank, args=(r, ranks, port, cfg.scaling_repeats, results))
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 120
    got: list[tuple[int, float, list[tuple[float, float, float]]]] = []
    while len(got) < ranks:
        if not results.empty():
            got.append(results.get())
        elif time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"process groups, {ranks} ranks: a rank failed or hung")
        else:
            time.sleep(0.01)
    for proc in procs:
        proc.join()
    connect = max(c for _, c, _ in got)
    rounds = list(zip(*(r for _, _, r in got), strict=True))  # per round: every rank's times
    init = [max(r[1] for r in rnd) - max(r[0] for r in rnd) for rnd in rounds]
    group = [max(r[2] for r in rnd) - max(r[1] for r in rnd) for rnd in rounds]
    return {
        "ranks": ranks,
        "first_init_s": round(max(r[1] for r in rounds[0]) - connect, 4),
        "reinit_median_s": round(statistics.median(init[1:]), 4),
        "reinit_s": [round(t, 4) for t in init[1:]],
        "new_group_median_s": round(statistics.median(group[1:]), 4),
    }


def growth(scaling: list[dict[str, Any]], key: str) -> float | None:
    """Exponent k of time ~ ranks^k, least squares on log-log."""
    points = [(math.log(s["ranks"]), math.log(s[key])) for s in scaling if s[key] > 0]
    if len(points) < 2:
        return None
    mx = statistics.mean(x for x, _ in points)
    my = statistics.mean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


# --------------------------------------------------------------------------- report


def report(
    cfg: Config, results: dict[str, dict[str, Any]], scaling: list[dict[str, Any]], wall: float
) -> dict[str, Any]:
    base = results["a"]["total_s"] if "a" in results else None
    for r in results.values():
        done = base is not None and r["total_s"] is not None
        r["reduction_vs_a"] = round(1 - r["total_s"] / base, 4) if done else None
    print_table(cfg, results, scaling)
    verdict = []
    time_pass: dict[str, bool] = {}
    for key in ("c",):  # the target; (d) and (e) are shown for comparison
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
    lost_pass = {
        k: r["lost_steps"] is not None and r["lost_steps"] <= cfg.memory_every
        for k, r in results.items()
        if k != "a"
    }
    if lost_pass:
        counts = {k: results[k]["lost_steps"] for k in lost_pass}
        lost = ", ".join(f"({k}) {'no recovery' if n is None else n}" for k, n in counts.items())
        verdict.append(
            f"target lost work <= memory snapshot interval ({cfg.memory_every} step(s)): "
            f"{'PASS' if all(lost_pass.values()) else 'FAIL'} ({lost}"
            + (f"; (a) {results['a']['lost_steps']})" if "a" in results else ")")
        )
    if not any(r["in_process"] and r["total_s"] is not None for r in results.values()):
        verdict.append(
            "no in-process recovery completed: every measured recovery restarted all workers"
        )
    k_init = growth(scaling, "reinit_median_s")
    k_group = growth(scaling, "new_group_median_s")
    if scaling:
        sizes = ", ".join(f"{s['ranks']}: {s['reinit_median_s'] * 1e3:.1f} ms" for s in scaling)
        groups = ", ".join(f"{s['ranks']}: {s['new_group_median_s'] * 1e3:.0f} ms" for s in scaling)
        verdict.append(
            f"process-group re-init by ranks (gloo, tiny state, median): default group {sizes}"
            + ("" if k_init is None else f" (about ranks^{k_init:.2f})")
            + f"; Checkpointer group (new_group) {groups}"
            + ("" if k_group is None else f" (about ranks^{k_group:.2f})")
            + f"; this host has {os.cpu_count()} cores, so larger worlds also share CPUs"
        )
    for line in verdict:
        print(line)
    return {
        "config": asdict(cfg) | {"ranks": cfg.ranks, "steps": cfg.steps},
        "checkpoint": "unbroken.Checkpointer, synchronous save (fsync), replicated_reads='each'",
        "scenarios": results,
        "targets": {"reduction_vs_a": TARGET_REDUCTION, "lost_steps_max": cfg.memory_every},
        "pass": {"time": time_pass, "lost_work": lost_pass},
        "scaling": scaling,
        "scaling_exponent": {"pg_reinit": k_init, "new_group": k_group},
        "wall_s": round(wall, 1),
    }


def print_table(
    cfg: Config, results: dict[str, dict[str, Any]], scaling: list[dict[str, Any]]
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"recovery: {cfg.nodes} simulated nodes x {cfg.nproc_per_node} ranks, "
        f"{cfg.mib_per_rank:g} MiB state per rank, CPU/gloo; disk checkpoint every "
        f"{cfg.save_every} steps, fault at step {cfg.fault_step}",
        caption="seconds, slowest rank at each phase boundary; total = fault -> every rank "
        f"completed a step again; back at step {cfg.fault_step}: lost steps redone too; "
        "procs: worker processes started anew ((a), (b), (d): torchrun restarts every worker; "
        "(c), (e): unbroken run --in-process replaces the lost ones only); step, snapshot: "
        "steady-state medians per rank before the fault. Process groups only: re-init of the "
        "default gloo group (PG init) and of a Checkpointer's group, new_group (setup), "
        f"median of {cfg.scaling_repeats - 1} rounds",
    )
    table.add_column("scenario")
    for _, title in PHASES:
        table.add_column(title, justify="right")
    table.add_column("total", justify="right")
    table.add_column(f"back at step {cfg.fault_step}", justify="right")
    table.add_column("restored from")
    table.add_column("lost steps", justify="right")
    table.add_column("procs", justify="right")
    table.add_column("step", justify="right")
    table.add_column("snapshot", justify="right")
    keys = list(results)
    for key in keys:
        r = results[key]
        if r["total_s"] is None:
            cells = ["-"] * len(PHASES) + ["no recovery", "-", r["failed"]]
            cells += ["-"] * (len(table.columns) - 1 - len(cells))
            table.add_row(r["short"], *cells, end_section=key == keys[-1])
            continue
        total = f"{r['total_s']:.2f}"
        if r["reduction_vs_a"] is not None and key != "a":
            total += f" ({-r['reduction_vs_a']:+.0%})"
        source = r["restored_from"].replace("shared memory", "memory")
        source = source.replace(", peer replicas for ranks", " + replicas for") + " @ "
        source += str(r["restored_step"])
        if r["cold_cache_resident"] is not None:
            source += f" ({r['cold_cache_resident']:.0%} cached)"
        table.add_row(
            r["short"],
            *(f"{r['phases_s'][k]:.2f}" for k, _ in PHASES),
            total,
            f"{r['back_at_fault_step_s']:.2f}",
            source,
            str(r["lost_steps"]),
            str(r["processes_restarted"]) + (" (spares)" if r["warm_spares_used"] else ""),
            _seconds(r["step_s"]),
            _seconds(r["snapshot_s"]),
            end_section=key == keys[-1],
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
    Console(width=200).print(table)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# --------------------------------------------------------------------------- main


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SIM_MEMORY_ROOT))
    except FileNotFoundError:
        return set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=float, default=256)
    parser.add_argument("--save-every", type=int, default=50, help="disk checkpoints")
    parser.add_argument("--fault-step", type=int, default=80)
    parser.add_argument("--memory-every", type=int, default=5, help="memory snapshots")
    parser.add_argument("--steps-after", type=int, default=5, help="steps run after the fault")
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=20.0,
        help="unbroken run's hang watchdog: a rank without progress this long is killed",
    )
    parser.add_argument(
        "--scenarios", default="abcde", help="which of a-e to run (default: all; (a) is the base)"
    )
    parser.add_argument(
        "--scaling-ranks",
        default="2,4,8",
        help="world sizes for the process-group measurement ('' to skip)",
    )
    parser.add_argument("--scaling-repeats", type=int, default=5)
    parser.add_argument("--dir", help="on a real disk (default: a temp dir under /tmp or the repo)")
    args = parser.parse_args()
    if args.nodes < 2 or args.nproc_per_node < 1:
        parser.error("need --nodes >= 2 (a node is lost in (c)) and --nproc-per-node >= 1")
    if not 0 < args.save_every < args.fault_step or args.fault_step % args.save_every == 0:
        parser.error("--fault-step must fall after the first disk checkpoint, between two")
    if args.memory_every < 1 or args.steps_after < 1 or args.scaling_repeats < 2:
        parser.error("need --memory-every >= 1, --steps-after >= 1, --scaling-repeats >= 2")
    scaling_ranks = tuple(int(n) for n in args.scaling_ranks.split(",") if n.strip())
    chosen = set(args.scenarios.replace(",", ""))
    if not chosen or chosen - set("abcde"):
        parser.error(f"--scenarios {args.scenarios!r}: pick from a, b, c, d, e")

    repo = Path(__file__).resolve().parent.parent
    parent = args.dir or (tempfile.gettempdir() if not on_tmpfs(tempfile.gettempdir()) else repo)
    Path(parent).mkdir(parents=True, exist_ok=True)
    if on_tmpfs(parent):
        parser.error(f"{parent} is in memory (tmpfs); pick a directory on a disk")
    workdir = tempfile.mkdtemp(prefix="unbroken-recovery-", dir=parent)
    cfg = Config(
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        mib_per_rank=args.mib_per_rank,
        save_every=args.save_every,
        fault_step=args.fault_step,
        memory_every=args.memory_every,
        steps_after=args.steps_after,
        heartbeat_timeout=args.heartbeat_timeout,
        scaling_ranks=scaling_ranks,
        scaling_repeats=args.scaling_repeats,
        dir=workdir,
    )
    shm_before = shm_entries()
    started = time.monotonic()
    try:
        results = {}
        for sc in (sc for sc in scenarios(cfg) if sc.key in chosen):
            print(f"running {sc.label} ...", flush=True)
            results[sc.key] = run_scenario(cfg, sc)
            r = results[sc.key]
            if r["total_s"] is not None:
                print(f"  {r['total_s']:.2f} s from fault to first step, {r['lost_steps']} lost")
        scaling = []
        for n in scaling_ranks:
            print(f"process-group init, {n} ranks ...", flush=True)
            scaling.append(run_scaling(cfg, n))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        # The launcher removes each job's shared memory; anything a killed run left is ours.
        for name in shm_entries() - shm_before:
            shutil.rmtree(os.path.join(SIM_MEMORY_ROOT, name), ignore_errors=True)
        if not shm_before:
            with contextlib.suppress(OSError):
                os.rmdir(SIM_MEMORY_ROOT)  # ours, if empty
    result = report(cfg, results, scaling, time.monotonic() - started)
    print("RESULT " + json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
