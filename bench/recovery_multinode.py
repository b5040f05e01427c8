"""Scenarios (f), (g) and (i) of bench/recovery.py: a multi-node ``unbroken run --in-process``
job, as on a cluster: an ``unbroken coordinator``, one node agent per node (each its own
process tree with its own shared-memory directory, on loopback), and a standby node agent
started without ``--node-rank`` (with warm spares) that claims the lost node's slot, as a
replacement pod would.

The fault is the node's own ``kill-node`` fault: its agent SIGKILLs itself, its ranks and
spares, and deletes its shared memory. Its moment is when this script sees the agent
dead (polled every 10 ms; the agent acts within its 50 ms poll of the fault). Phase
boundaries, each the last rank to pass it: detect (-> a healthy rank saw the peer gone
or aborted its groups), restart (-> the coordinator started the next generation, the
standby agent holding the slot: the rank's report, the coordinator's ping and its
--suspect-timeout, the standby's claim), then as in the other scenarios.

(i) stops the last node instead: its first rank, after the fault step, SIGSTOPs its
agent, every process below it and itself (`recovery_worker.stop_node`), and logs the
moment first. No connection closes and no rank reports anything: the coordinator finds
the node by its agent's silent beat and an unanswered ping (``--ping-after``,
``--answer-timeout``). Once the others are done the stopped tree is woken and killed."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from recovery_jobs import WORKER, JobFailed, failed, read_events, worker_args
from recovery_scenarios import PHASES, RecoveryConfig, Scenario
from unbroken.run.procs import descendants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers.etcd import LocalEtcd  # tests/servers: the tests start it too

NODE_TIMEOUT_S = 1.0
JOB_TIMEOUT_S = 300.0
DETECTED_BY = {False: "a rank's report, the coordinator's ping", True: "a ping of the silent agent"}
# As a deployment across machines must: every store connection passes the coordinator's
# gate (the coordinator and the agents inherit it).
os.environ.setdefault("UNBROKEN_JOB_SECRET", secrets.token_hex(32))


def start_coordinator(where: Path, etcd: str | None = None) -> tuple[subprocess.Popen[str], str]:
    """A coordinator, and the nodes' --rdzv-endpoint: its address, or the ``etcd`` URL
    (where it must lead before it returns)."""
    store = [f"--etcd={etcd}"] if etcd else ["--host=127.0.0.1", "--port=0"]
    cmd = [sys.executable, "-m", "unbroken", "coordinator", *store,
           f"--node-timeout={NODE_TIMEOUT_S:g}", "--exit-when-done"]  # fmt: skip
    with open(where / f"coordinator-{len(list(where.glob('coordinator*')))}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if ("leading the job" if etcd else "listening on") not in line:
        raise JobFailed(f"the coordinator did not start: {line!r}")
    return proc, etcd or f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}"


def run_multinode_scenario(cfg: RecoveryConfig, sc: Scenario) -> dict[str, Any]:
    """Scenario ``sc`` (f or g): its result, as `recovery_jobs.run_scenario` gives it."""
    where = Path(cfg.dir) / sc.key
    (where / "events").mkdir(parents=True)
    started = time.monotonic()
    try:
        run = run_multinode(cfg, sc, where)
        result = analyse_multinode(cfg, sc, where / "events", run)
    except JobFailed as e:
        result = failed(sc, e, {})
    result["job_wall_s"] = round(time.monotonic() - started, 2)
    shutil.rmtree(where, ignore_errors=True)
    return result


def run_multinode(cfg: RecoveryConfig, sc: Scenario, where: Path) -> dict[str, Any]:
    """Run the job; the launcher-side events (absolute times) and the fault's moment."""
    job = f"bench-{uuid.uuid4().hex[:8]}"
    shm = Path(f"/dev/shm/unbroken-{job}")
    etcd = LocalEtcd(where) if sc.etcd else None
    coordinator, endpoint = start_coordinator(where, etcd.url(job) if etcd else None)
    # (j): a standby coordinator, which takes the lead when the leader dies with node 0.
    standby = start_standby(where, endpoint) if etcd else None
    agents: list[subprocess.Popen[bytes]] = []

    def agent(node: int | None) -> None:
        i = len(agents)
        cmd = [
            sys.executable, "-m", "unbroken", "run", *sc.launcher, f"--nnodes={cfg.nodes}",
            f"--nproc-per-node={cfg.nproc_per_node}",
            *([] if node is None else [f"--node-rank={node}"]),
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", "--max-restarts=2",
            f"--heartbeat-timeout={cfg.heartbeat_timeout:g}",
            *([] if sc.stop else [f"--inject-fault={sc.fault}"]),
            f"--timeline-json={where / f'agent-{i}.json'}", str(WORKER),
            *worker_args(cfg, sc, where),
            *(stop_args(cfg) if sc.stop else []),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_MEMORY_DIR": str(shm / str(i))}
        with open(where / f"agent-{i}.log", "w") as log:
            agents.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    try:
        for node in range(cfg.nodes):
            agent(node)
        # The standby node, started once the others hold their slots: it waits for one.
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not all(
            "node agent" in (where / f"agent-{i}.log").read_text() for i in range(cfg.nodes)
        ):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                raise JobFailed("the node agents did not start", tail(where))
            time.sleep(0.1)
        if not sc.late_s:
            agent(None)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        if sc.stop:
            fault_t = wait_stopped(agents, agents[cfg.nodes - 1], deadline, where)
        else:
            leader = coordinator if standby else None
            late = (sc.late_s, lambda: agent(None)) if sc.late_s else None
            fault_t = wait(agents, deadline, where, leader, late)
        (standby or coordinator).wait(timeout=30)
    finally:
        if sc.stop and agents[cfg.nodes - 1 :]:
            release(agents[cfg.nodes - 1])
        procs: list[subprocess.Popen[Any]] = [*agents, coordinator, *([standby] if standby else [])]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if etcd is not None:
            etcd.close()
        shutil.rmtree(shm, ignore_errors=True)
    return {"fault_t": fault_t, "events": timelines(where)}


def timelines(where: Path) -> list[dict[str, Any]]:
    """The agents' timeline events, in absolute time."""
    events = []
    for path in sorted(where.glob("agent-*.json")):
        timeline = json.loads(path.read_text())
        events += [e | {"t": e["t"] + timeline["t0"]} for e in timeline["events"]]
    return events


def start_standby(where: Path, url: str) -> subprocess.Popen[str]:
    """(j): a second coordinator on the same etcd, standing by for the lead."""
    cmd = [sys.executable, "-m", "unbroken", "coordinator", f"--etcd={url}",
           f"--node-timeout={NODE_TIMEOUT_S:g}", "--exit-when-done"]  # fmt: skip
    with open(where / "coordinator-standby.log", "w") as log:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)


def wait(
    agents: list[subprocess.Popen[bytes]],
    deadline: float,
    where: Path,
    leader: subprocess.Popen[str] | None = None,
    late: tuple[float, Callable[[], None]] | None = None,
) -> float:
    """Wait for the job's end; when the first agent died (wall clock). (j): ``leader``,
    the leading coordinator, is killed at that moment too. (k): ``late`` = (seconds,
    start), the standby node is started that long after it."""
    fault_t = None
    while any(a.poll() is None for a in agents):
        if fault_t is None and any(a.poll() is not None for a in agents):
            fault_t = time.time()
            if leader is not None:
                leader.kill()
        if late is not None and fault_t is not None and time.time() >= fault_t + late[0]:
            late[1]()
            late = None
        if time.monotonic() > deadline:
            raise JobFailed(f"timed out after {JOB_TIMEOUT_S:g} s", tail(where))
        time.sleep(0.01)
    codes = sorted(a.returncode for a in agents)
    if fault_t is None or codes.count(0) != len(agents) - 1:
        raise JobFailed(f"agents exited {codes}, expected one SIGKILL and 0s", tail(where))
    return fault_t


def stop_args(cfg: RecoveryConfig) -> list[str]:
    """(i): the first rank of the last node stops its node after the fault step."""
    return [f"--stop-rank={(cfg.nodes - 1) * cfg.nproc_per_node}", f"--stop-step={cfg.fault_step}"]


def wait_stopped(
    agents: list[subprocess.Popen[bytes]],
    stopped: subprocess.Popen[bytes],
    deadline: float,
    where: Path,
) -> float:
    """(i): wait for the job's end without the stopped node; when its rank stopped it
    (wall clock, from its ``node_stopped`` event)."""
    fault_t = None
    others = [a for a in agents if a is not stopped]
    while any(a.poll() is None for a in others):
        if fault_t is None:
            found = [e for e in read_events(where / "events") if e["event"] == "node_stopped"]
            fault_t = found[0]["t"] if found else None
        if time.monotonic() > deadline:
            raise JobFailed(f"timed out after {JOB_TIMEOUT_S:g} s", tail(where))
        time.sleep(0.01)
    found = [e for e in read_events(where / "events") if e["event"] == "node_stopped"]
    codes = sorted(a.returncode for a in others)
    if not found or set(codes) != {0}:
        raise JobFailed(f"agents exited {codes}, node stopped: {bool(found)}", tail(where))
    return float(found[0]["t"])


def release(stopped: subprocess.Popen[bytes]) -> None:
    """Wake the stopped node's processes and kill them: none is left behind stopped."""
    pids = [stopped.pid, *descendants(stopped.pid)]
    for sig in (signal.SIGCONT, signal.SIGKILL):  # one by one: the agent is in our group
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    stopped.wait()


def tail(where: Path) -> str:
    return "\n".join(
        f"{p.name}: {line}" for p in sorted(where.glob("*.log"))
        for line in p.read_text(errors="replace").splitlines()[-8:]
    )  # fmt: skip


def phase_bounds(
    fault: float, tl: list[dict[str, Any]], mine: list[dict[str, Any]], stepped: float
) -> list[float]:
    """When each phase ended, the fault first: each the last rank's moment, from the
    agents' timelines ``tl`` and the workers' events ``mine`` after the fault."""

    def last(name: str, source: list[dict[str, Any]]) -> float:
        times = [e["t"] for e in source if e["event"] == name]
        if not times:
            raise JobFailed(f"no {name!r} event after the fault")
        return float(max(times))

    return [
        fault,
        min(e["t"] for e in tl if e["event"] in ("abort", "peer_failure")),
        last("generation", tl),
        last("init_start", tl),
        last("init_done", tl),
        last("restore_start", mine),
        last("restore_end", mine),
        stepped,
    ]


def analyse_multinode(cfg: RecoveryConfig, sc: Scenario, out: Path, run: dict[str, Any]) -> dict:
    """Phases and totals of the one recovery, from the agents' timelines and the workers'
    events, as `recovery_jobs.analyse` gives them for the one-machine scenarios."""
    fault = run["fault_t"]
    tl = [e for e in run["events"] if e["t"] > fault]
    mine = [e for e in read_events(out) if e["t"] > fault]
    ends = [e for e in mine if e["event"] == "restore_end"]
    restored = {e["restored"] for e in ends}
    if len(ends) != cfg.ranks or len(restored) != 1:
        raise JobFailed(f"{len(ends)} ranks restored, steps {sorted(map(str, restored))}")
    (restored_step,) = restored
    firsts: dict[int, float] = {}
    for e in sorted(mine, key=lambda e: e["t"]):
        if e["event"] == "step_done":
            firsts.setdefault(e["rank"], e["t"])
    bounds = phase_bounds(fault, tl, mine, max(firsts.values()))
    steps = zip(PHASES, pairwise(bounds), strict=True)
    phases = {key: round(b - a, 3) for (key, _), (a, b) in steps}
    past = [e for e in mine if e["event"] == "step_done" and e["step"] >= cfg.fault_step]
    back = max(min(e["t"] for e in past if e["rank"] == rank) for rank in firsts)
    spawned = [e for e in tl if e["event"] in ("respawn", "spawn") and e.get("generation", 0) > 0]
    # Ranks restored after the fault in another process than they trained in before it:
    # the lost node's, and any survivor restarted.
    pids = {e["rank"]: e["pid"] for e in read_events(out) if e["t"] <= fault}
    moved = sum(1 for e in ends if pids.get(e["rank"]) != e["pid"])
    return {
        "short": sc.short,
        "label": sc.label,
        "fault": sc.fault,
        "fault_step": cfg.fault_step,
        "detected_by": DETECTED_BY[sc.stop],
        "memory_every": sc.memory_every,
        "replicas": sc.replicas,
        "in_process": True,
        "launcher_options": list(sc.launcher),
        "node_timeout_s": NODE_TIMEOUT_S,
        "processes_restarted": len(spawned),
        "survivors_restarted": moved - cfg.nproc_per_node,
        "warm_spares_used": sum(1 for e in spawned if e.get("spare")),
        "phases_s": phases,
        "total_s": round(bounds[-1] - fault, 3),
        "back_at_fault_step_s": round(back - fault, 3),
        "restored_step": restored_step,
        "restored_from": "+".join(sorted({str(e["source"]) for e in ends})),
        "lost_steps": cfg.fault_step - restored_step,
        "cold_cache_resident": None,
        "step_s": None,
        "snapshot_s": None,
    }
