"""One scenario of bench/recovery.py as a real job under ``unbroken run``, and its phases
read from the launcher's timeline and the workers' event logs."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from recovery_scenarios import PHASES, RecoveryConfig, Scenario

WORKER = Path(__file__).with_name("recovery_worker.py")
JOB_TIMEOUT_S = 300.0


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


def worker_args(cfg: RecoveryConfig, sc: Scenario, where: Path) -> list[str]:
    """recovery_worker.py's arguments for scenario ``sc`` in folder ``where``."""
    return [
        f"--out={where / 'events'}",
        f"--ckpt={where / 'ckpt'}",
        f"--steps={cfg.steps}",
        f"--save-every={cfg.save_every}",
        f"--memory-every={sc.memory_every}",
        f"--replicas={sc.replicas}",
        f"--mib-per-rank={cfg.mib_per_rank}",
        *(["--cold"] if sc.cold else []),
        *(["--live"] if sc.live else []),
    ]


def failed(sc: Scenario, e: JobFailed, timeline: dict[str, Any]) -> dict[str, Any]:
    """The result of a scenario whose job did not recover."""
    print(f"  FAILED: {e.why}\n" + textwrap.indent(e.tail, "    | "), flush=True)
    return {
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


def run_scenario(cfg: RecoveryConfig, sc: Scenario) -> dict[str, Any]:
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
    started = time.monotonic()
    try:
        launch(options, worker_args(cfg, sc, where), where, timeout=JOB_TIMEOUT_S)
        result = analyse(cfg, sc, json.loads(timeline_path.read_text()), read_events(out))
    except JobFailed as e:
        timeline = json.loads(timeline_path.read_text()) if timeline_path.exists() else {}
        result = failed(sc, e, timeline)
    result["job_wall_s"] = round(time.monotonic() - started, 2)
    shutil.rmtree(where, ignore_errors=True)  # the checkpoints: 256 MiB per disk save
    return result


def analyse(
    cfg: RecoveryConfig, sc: Scenario, timeline: dict[str, Any], events: list[dict[str, Any]]
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
    phases, back = phase_times(cfg, sc, rec, tl, mine)
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


def last_passed(name: str, source: list[dict[str, Any]], count: int) -> float:
    """When the last of ``count`` ranks logged ``name`` in ``source``."""
    times = [e["t"] for e in source if e["event"] == name]
    if len(times) != count:
        raise JobFailed(f"{len(times)} {name!r} events after the fault, not {count}")
    return float(max(times))


def phase_times(
    cfg: RecoveryConfig,
    sc: Scenario,
    rec: dict[str, Any],
    tl: list[dict[str, Any]],
    mine: list[dict[str, Any]],
) -> tuple[dict[str, float], float]:
    """Each phase's seconds, and when every rank completed the fault step again, from the
    launcher's events ``tl`` and the workers' ``mine`` after the fault of ``rec``."""

    def last(name: str, source: list[dict[str, Any]], count: int = cfg.ranks) -> float:
        return last_passed(name, source, count)

    fault = rec["fault_t"]
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
    return {key: round(b - a, 3) for (key, _), (a, b) in steps}, back


def _median(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None
