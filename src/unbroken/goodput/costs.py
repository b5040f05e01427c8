"""What a failure and a checkpoint cost, per strategy, for `unbroken.goodput.simulate`.

Costs come from unbroken's own benchmarks (`Measured`: bench/recovery.py's phases, this
machine's README table by default, or the ``RESULT`` lines of a run, `from_results`),
scaled to a cluster by the hardware and cluster assumptions of `Cluster` (bandwidths,
scheduler and communicator set-up times). `strategy_costs` turns both into `Costs`.

Two strategies:

* ``traditional``: synchronous checkpoints to the object store; on any failure every
  process restarts (torchrun restart-all, or the scheduler relaunching the job) and
  restores from the object store; a hang is found by the collective timeout; the work
  since the last checkpoint is lost.
* ``checkpointless``: unbroken's in-process recovery: memory snapshots (a device-to-host
  copy; replication to a peer node overlaps training), only the failed ranks replaced
  from warm spares, restored from peers over the NIC, a hang found by the heartbeat
  watchdog; with live healing (`Checkpointer.step`) at most the step in flight is lost,
  else the work since the last snapshot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

KINDS = ("process", "node", "hang")


@dataclass(frozen=True)
class Measured:
    """Phase times (seconds) from bench/recovery.py for one strategy's scenario, and the
    set-up they were measured on. Defaults: README's table, scenario (a) (traditional)."""

    detect: float = 0.07
    restart: float = 1.51
    startup: float = 5.83
    pg_init: float = 0.43
    setup: float = 0.16
    restore: float = 0.56
    first_step: float = 0.11
    step_s: float = 0.08
    snapshot_s: float = 0.11  # per snapshot, measured state size
    state_gb: float = 0.268  # per rank (256 MiB)
    ranks: int = 4


# README, bench/recovery.py: (a) traditional; (c) in-process, warm spares, one machine.
TRADITIONAL = Measured()
CHECKPOINTLESS = Measured(
    detect=0.0,
    restart=0.26,
    startup=0.15,
    pg_init=0.01,
    setup=0.01,
    restore=0.54,
    first_step=0.09,
    step_s=0.14,
)


@dataclass(frozen=True)
class Cluster:
    """The cluster the projection is for. Bandwidths in GB/s; times in seconds."""

    gpus: int = 2304
    gpus_per_node: int = 8
    gpu_mtbf_hours: float = 50_000.0
    state_gb_per_gpu: float = 10.0
    mix: tuple[float, float, float] = (0.5, 0.4, 0.1)  # process, node, hang
    d2h_gbps: float = 25.0  # device-to-host copy, per GPU (PCIe gen4/5)
    nic_gbps: float = 12.5  # network, per GPU (100 Gb/s)
    store_gbps: float = 200.0  # object store, aggregate over the job
    step_s: float = 10.0  # one training step at this scale
    job_restart_s: float = 120.0  # traditional: scheduler tears down and relaunches all
    node_replace_s: float = 0.0  # getting a replacement node (0: a spare is ready)
    startup_s: float = 60.0  # a new process: imports, CUDA init, model build at scale
    comm_init_s: float = 15.0  # GPU communicators (NCCL) set up again, whole job
    collective_timeout_s: float = 600.0  # traditional hang detection (NCCL default)
    heartbeat_timeout_s: float = 60.0  # checkpointless hang detection (unbroken run)
    node_timeout_s: float = 1.0  # a lost node, as unbroken's coordinator sees it
    rendezvous_timeout_s: float = 15.0  # traditional: torchrun's keep-alives (3 x 5 s)
    live: bool = True  # checkpointless: live healing, at most the step in flight lost
    data_warmup_s: float = 0.0  # data pipeline warm-up after a restart

    @property
    def mtbf_s(self) -> float:
        """The whole job's mean time between failures."""
        return self.gpu_mtbf_hours * 3600.0 / self.gpus


@dataclass(frozen=True)
class Costs:
    """One strategy on one cluster: per failure kind, the time to detect; then the
    recovery phases; the stall per checkpoint; what a failure loses."""

    strategy: str
    detect: dict[str, float]
    restart: float
    init: float
    restore: float
    data: float
    stall: float  # training blocked per checkpoint
    lose_since_checkpoint: bool  # else one step at most (live healing)
    step_s: float

    def recovery_s(self, kind: str) -> float:
        """Fault to training again, if nothing else fails meanwhile."""
        return self.detect[kind] + self.restart + self.init + self.restore + self.data


def strategy_costs(strategy: str, cluster: Cluster, measured: Measured | None = None) -> Costs:
    """``traditional`` or ``checkpointless`` on ``cluster``; process-level costs from
    ``measured`` (default: this machine's README figures for that strategy)."""
    c = cluster
    if strategy == "traditional":
        m = measured or TRADITIONAL
        store = min(c.nic_gbps, c.store_gbps / c.gpus)  # each GPU's share
        return Costs(
            strategy,
            {
                "process": m.detect,
                "node": c.rendezvous_timeout_s,
                "hang": c.collective_timeout_s,
            },
            restart=m.restart + c.job_restart_s + c.node_replace_s * c.mix[1],
            init=max(m.startup, c.startup_s) + m.pg_init + m.setup + c.comm_init_s,
            restore=c.state_gb_per_gpu / store + m.first_step,
            data=c.data_warmup_s,
            stall=c.state_gb_per_gpu / store,
            lose_since_checkpoint=True,
            step_s=c.step_s,
        )
    if strategy == "checkpointless":
        m = measured or CHECKPOINTLESS
        return Costs(
            strategy,
            {
                "process": m.detect,
                "node": c.node_timeout_s,
                "hang": c.heartbeat_timeout_s,
            },
            restart=m.restart,
            init=m.startup + m.pg_init + m.setup + c.comm_init_s,
            restore=c.state_gb_per_gpu / c.nic_gbps + m.first_step,
            data=c.data_warmup_s,
            stall=c.state_gb_per_gpu / c.d2h_gbps,
            lose_since_checkpoint=not c.live,
            step_s=c.step_s,
        )
    raise ValueError(f"strategy {strategy!r}: traditional or checkpointless")


def from_results(path: Path) -> dict[str, Measured]:
    """Measured phases from a file holding bench/recovery.py's ``RESULT {json}`` line
    (other lines are skipped): scenario (a) as traditional, (c) as checkpointless."""
    out: dict[str, Measured] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("RESULT "):
            continue
        result = json.loads(line[len("RESULT ") :])
        scenarios = result.get("scenarios") if isinstance(result, dict) else None
        if not scenarios:
            continue
        for key, strategy in (("a", "traditional"), ("c", "checkpointless")):
            if key in scenarios and scenarios[key].get("phases_s"):
                out[strategy] = _measured(scenarios[key], result.get("config", {}))
    if not out:
        raise ValueError(f"{path}: no RESULT line of bench/recovery.py with scenarios a or c")
    return out


def _measured(s: dict[str, Any], config: dict[str, Any]) -> Measured:
    p = s["phases_s"]
    keys = ("detect", "restart", "startup", "pg_init", "setup", "restore", "first_step")
    base = Measured(**{k: float(p[k]) for k in keys})  # type: ignore[arg-type]
    return replace(
        base,
        step_s=float(s.get("step_s") or base.step_s),
        snapshot_s=float(s.get("snapshot_s") or base.snapshot_s),
        state_gb=float(s.get("state_mib_per_rank", 256)) * 2**20 / 1e9,
        ranks=int(config.get("ranks", 4)),
    )
