"""The storm: a seeded fault schedule, the same for every method, and the driver that
runs one method's job through it.

Faults are named by data-parallel rank, so they mean the same whatever launcher runs the
job: ``crash`` SIGKILLs the rank's process, ``hang`` SIGSTOPs it (the method must find
it: nothing closes), ``node`` SIGKILLs the whole process tree of the node that holds the
rank, and its shared memory with it. The first four are a crash, a hang, the loss of rank
0's node and the loss of another node, in a seeded order; crashes and node losses follow.
A lost node is replaced as the method expects (`storm_launch.Launch.standby`): a standby
node already waiting, with the next standby --replace-delay seconds later, or a new node
in the lost one's place after that delay."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storm_launch import Config, Launch, kill_tree
from unbroken.run.procs import descendants


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the job's first step
    kind: str  # crash, hang or node
    rank: int


def schedule(cfg: Config, count: int = 200) -> list[Fault]:
    rng = random.Random(cfg.seed)
    first = [("crash", rng.randrange(cfg.ranks)), ("hang", rng.randrange(cfg.ranks)),
             ("node", 0), ("node", cfg.ranks - 1)]  # fmt: skip
    rng.shuffle(first)
    rest = [("crash" if rng.random() < 0.6 else "node", rng.randrange(cfg.ranks))
            for _ in range(count - len(first))]  # fmt: skip
    return [Fault(cfg.every * (i + 1), k, r) for i, (k, r) in enumerate(first + rest)]


@dataclass
class Node:
    index: int | None
    procs: list[subprocess.Popen[bytes]]
    memory: Path

    def pids(self) -> set[int]:
        return {p for proc in self.procs for p in (proc.pid, *descendants(proc.pid))}


@dataclass
class Run:
    """One method's job: its nodes, what the storm did to it, and when."""

    launch: Launch
    cfg: Config
    out: Path
    t0: float = field(default_factory=time.time)
    services: list[subprocess.Popen[bytes]] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[tuple[float, int | None]] = field(default_factory=list)
    failed: str | None = None

    def start_node(self, index: int | None) -> None:
        name = len(self.nodes) + len(self.faults) if index is None else index
        memory = Path(f"/dev/shm/unbroken-storm-{os.getpid()}-{self.launch.key}-{name}")
        os.environ["UNBROKEN_MEMORY_DIR"] = str(memory)  # the node's own shared memory
        try:
            procs = self.launch.node(self.out, index)
        finally:
            del os.environ["UNBROKEN_MEMORY_DIR"]
        self.nodes.append(Node(index, procs, memory))

    def pid_of(self, rank: int) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.out / "pids" / f"rank-{rank}").read_text())
            os.kill(pid, 0)
            if pid not in self.stopped:
                return pid
        return None

    def strike(self, fault: Fault) -> bool:
        """Deliver ``fault`` if its rank has a live process now (False: try again)."""
        pid = self.pid_of(fault.rank)
        if pid is None:
            return False
        record: dict[str, Any] = {"t": time.time(), "kind": fault.kind, "rank": fault.rank}
        if fault.kind == "crash":
            os.kill(pid, signal.SIGKILL)
        elif fault.kind == "hang":
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)
        else:
            node = next((n for n in self.nodes if pid in n.pids()), None)
            if node is None:
                return False
            for proc in node.procs:
                kill_tree(proc)
            shutil.rmtree(node.memory, ignore_errors=True)
            self.nodes.remove(node)
            replace_at = time.time() + self.cfg.replace_delay
            record["node"] = node.index
            if self.launch.restart_job:
                self.stop_job()
                self.arrivals.append((replace_at, -1))
            else:
                self.arrivals.append((replace_at, None if self.launch.standby else node.index))
        self.faults.append(record)
        return True

    def stop_job(self) -> None:
        """What a scheduler does to a job that lost a node: every process goes."""
        for proc in [p for n in self.nodes for p in n.procs] + self.services:
            kill_tree(proc)
        self.nodes, self.services = [], []

    def arrive(self) -> None:
        """Start the replacements whose delay has passed (-1: the whole job)."""
        for when, index in list(self.arrivals):
            if time.time() >= when:
                self.arrivals.remove((when, index))
                if index != -1:
                    self.start_node(index)
                    continue
                self.services = self.launch.services(self.out)
                for node in range(self.cfg.nodes):
                    self.start_node(node)

    def close(self) -> None:
        """End every process of the run first (agents restart their ranks for as long as
        they live), then write down its faults."""
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.stop_job()
        for memory in Path("/dev/shm").glob(f"unbroken-storm-{os.getpid()}-*"):
            shutil.rmtree(memory, ignore_errors=True)
        (self.out / "faults.json").write_text(json.dumps({"t0": self.t0, "faults": self.faults}))


def joined(out: Path, nodes: int, wait_s: float = 60.0) -> None:
    """Wait until every numbered node's agent says it holds its slot: a standby started
    beside them may take a slot first, leaving that node's agent (which wants only its
    own) waiting as a standby for that one slot."""
    logs = [out / f"node-{index}.log" for index in range(nodes)]
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if all(log.exists() and "node agent" in log.read_text(errors="replace") for log in logs):
            return
        time.sleep(0.1)


def drive(launch: Launch, cfg: Config, out: Path, faults: list[Fault], timeout: float) -> Run:
    """Run ``launch``'s job through ``faults`` until a rank logs ``final``."""
    out.mkdir(parents=True)
    run = Run(launch, cfg, out)
    try:
        run.services = launch.services(out)
        for index in range(cfg.nodes):
            run.start_node(index)
        if launch.standby:
            joined(out, cfg.nodes)
            run.start_node(None)
        first = None
        pending = list(faults)
        while not (out / "final").exists():
            if time.time() - run.t0 > timeout:
                run.failed = f"no final step after {timeout:.0f} s"
                return run
            if first is None and (out / "stepped").exists():
                first = time.time()
            late = 0.0 if first is None or not pending else time.time() - first - pending[0].at
            if late >= 0 and first is not None and pending and run.strike(pending[0]):
                pending.pop(0)
            elif late > 5:  # its rank has no live process for now (hung, replaced): the next
                fault = pending[0]
                pending[0] = Fault(fault.at, fault.kind, (fault.rank + 1) % cfg.ranks)
            run.arrive()
            time.sleep(0.05)
        ends = time.time() + 20  # the other ranks' last step and digest; the nodes' exit
        while time.time() < ends and (
            len(list(out.glob("final-*"))) < cfg.ranks
            or any(p.poll() is None for n in run.nodes if n.index is not None for p in n.procs)
        ):
            time.sleep(0.05)
    finally:
        run.close()
    return run
