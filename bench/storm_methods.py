"""How methods (a), (b), (c) and (e) of bench/storm.py run the job (bench/storm_worker.py);
(d), torchft, is bench/storm_torchft.py.

(a) and (e) are torchrun as teams run it across machines: c10d rendezvous on a store that
outlives any node (here a TCPStore process, as an etcd or a head node would be), torchrun's
default keep-alives, every worker restarted on a crash; a lost node restarts the whole job
once its replacement arrives (`storm_launch.Launch.restart_job`). (A standby agent in the
rendezvous' redundancy list made every agent restart its workers every ~2 s here.) (b) is
the same launch under ``unbroken run`` (its keep-alives of 1 s, its heartbeat watchdog);
(c) is ``unbroken run --in-process --warm-spare``: an ``unbroken coordinator``, one agent
per node and a standby agent with warm spares."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from common import free_port
from storm_launch import HERE, Config, Launch, Procs, python, start

WORKER = str(HERE / "storm_worker.py")
STORE = (
    "import sys, time; from datetime import timedelta; import torch.distributed as d; "
    "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False, "
    "multi_tenant=True, timeout=timedelta(days=1)); time.sleep(1e9)"
)


class Store:
    """The rendezvous store: a new one (a new port) for each incarnation of the job."""

    def __init__(self) -> None:
        self.port = 0

    def __call__(self, out: Path) -> Procs:
        self.port = free_port()
        proc = start(out, "store", python("-c", STORE, str(self.port)))
        time.sleep(1.0)  # listening before the first node connects
        return [proc]


def local_addr(index: int | None) -> str:
    """A loopback address of the node's own, as machines have: c10d's rendezvous orders
    nodes by address, and a replacement takes the lost node's."""
    return f"--local-addr=127.0.{100 + (index or 0)}.1"


def worker(cfg: Config, out: Path, method: str, *extra: str) -> list[str]:
    return [WORKER, f"--method={method}", f"--out={out}", f"--ckpt={out / 'ckpt'}",
            f"--steps={cfg.steps}", f"--timeout={cfg.hang_timeout:g}", *extra]  # fmt: skip


def torchrun(cfg: Config, key: str, label: str, method: str, *extra: str) -> Launch:
    """(a) or (e): torchrun and its c10d rendezvous."""
    store = Store()
    restarts = "0" if method == "plain" else "1000"

    def node(out: Path, index: int | None) -> Procs:
        cmd = python(
            "-m", "torch.distributed.run", f"--nnodes={cfg.nodes}",
            f"--nproc-per-node={cfg.per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=storm",
            "--rdzv-conf=is_host=false",
            f"--max-restarts={restarts}", "--monitor-interval=0.5", local_addr(index),
            *worker(cfg, out, method, *extra),
        )  # fmt: skip
        # torch 2.13's shared store: an agent that stays rank 0 keeps the MASTER_ADDR of
        # its first round and never writes it under the new round's prefix, so a node that
        # joins later waits for it for ever. Off, as unbroken run sets it.
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        return [start(out, f"node-{'standby' if index is None else index}", cmd, **env)]

    return Launch(key, label, store, node, standby=False)


def restart_all(cfg: Config, save_every: int) -> Launch:
    """(b): ``unbroken run`` restarting every worker, from memory snapshots and replicas."""
    store = Store()

    def node(out: Path, index: int | None) -> Procs:
        cmd = python(
            "-m", "unbroken", "run", f"--nnodes={cfg.nodes}", f"--nproc-per-node={cfg.per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=storm",
            "--rdzv-conf=is_host=false", "--max-restarts=1000", "--monitor-interval=0.5",
            local_addr(index), f"--heartbeat-timeout={cfg.hang_timeout:g}",
            f"--hang-factor={cfg.hang_factor:g}",
            *worker(cfg, out, "unbroken", "--memory-every=5", f"--save-every={save_every}"),
        )  # fmt: skip
        return [start(out, f"node-{'standby' if index is None else index}", cmd)]

    label = "unbroken run, restart all: memory snapshots every 5 steps, background saves"
    return Launch("b", label, store, node, standby=False, restart_job=True)


def in_process(cfg: Config, save_every: int) -> Launch:
    """(c): live healing across node agents, warm spares, a standby node."""
    os.environ.setdefault("UNBROKEN_JOB_SECRET", secrets.token_hex(32))
    job = f"storm-{secrets.token_hex(4)}"
    endpoint: list[str] = []

    def services(out: Path) -> Procs:
        cmd = python("-m", "unbroken", "coordinator", "--host=127.0.0.1", "--port=0",
                     "--node-timeout=1", "--exit-when-done")  # fmt: skip
        proc = start(out, "coordinator", cmd)
        deadline = time.time() + 60
        while not endpoint:
            for line in (out / "coordinator.log").read_text().splitlines():
                if "listening on" in line:
                    endpoint.append(f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}")
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the coordinator did not start: see {out}/coordinator.log")
            time.sleep(0.1)
        return [proc]

    def node(out: Path, index: int | None) -> Procs:
        cmd = python(
            "-m", "unbroken", "run", "--in-process", "--warm-spare", f"--nnodes={cfg.nodes}",
            f"--nproc-per-node={cfg.per_node}",
            *([] if index is None else [f"--node-rank={index}"]),
            f"--rdzv-endpoint={endpoint[0]}", f"--rdzv-id={job}", "--max-restarts=1000",
            f"--heartbeat-timeout={cfg.hang_timeout:g}", f"--hang-factor={cfg.hang_factor:g}",
            *worker(cfg, out, "unbroken", "--live", "--memory-every=10",
                    f"--save-every={save_every}"),
        )  # fmt: skip
        return [start(out, f"node-{'standby' if index is None else index}", cmd)]

    label = "unbroken run --in-process: live healing, warm spares, a standby node"
    return Launch("c", label, services, node, standby=True)


def dcp(cfg: Config, save_every: int) -> Launch:
    label = f"torchrun + DCP async_save every {save_every} steps (Young/Daly)"
    return torchrun(cfg, "a", label, "dcp", f"--save-every={save_every}")


def reference(cfg: Config) -> Launch:
    label = "reference: torchrun, no checkpoint, no fault"
    return torchrun(cfg, "e", label, "plain", "--calibrate", "--save-every=1")
