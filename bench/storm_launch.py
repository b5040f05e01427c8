"""What bench/storm.py's driver needs of a method: how it starts its services and a node,
and whether it keeps a standby node. Each method's module returns a `Launch`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from unbroken.run import procs

HERE = Path(__file__).resolve().parent
Procs = list[subprocess.Popen[bytes]]


@dataclass(frozen=True)
class Config:
    """The job and its storm, the same for every method."""

    steps: int
    every: float  # seconds between faults
    seed: int
    nodes: int = 2
    per_node: int = 2
    replace_delay: float = 10.0  # a lost node's replacement arrives this much later
    hang_timeout: float = 10.0  # what a method is given to find a hung rank
    hang_factor: float = 5.0  # (b), (c): unbroken's watchdog learns each rank's pace (0: off)

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


@dataclass
class Launch:
    """How one method runs the job. ``services`` starts what outlives any node (a
    rendezvous store, a coordinator, a lighthouse); ``node(out, n)`` starts node ``n``'s
    processes (``n`` None: a standby node, where the method keeps one). The job is over
    when every rank has logged ``final``. ``restart_job``: a lost node restarts the whole
    job (every node and the services anew, once its replacement arrives), as a scheduler
    does for a torchrun job (JobSet's or Slurm's failure policy): torchrun's rendezvous
    did not take a replacement agent here (the agents waited 60 s on each other's rank
    assignment, then gave up).

    Each node's ``$UNBROKEN_MEMORY_DIR`` is its own and outlives its agents, not the node."""

    key: str
    label: str
    services: Callable[[Path], list[subprocess.Popen[bytes]]]
    node: Callable[[Path, int | None], list[subprocess.Popen[bytes]]]
    standby: bool
    restart_job: bool = False


def start(out: Path, name: str, cmd: list[str], **env: str) -> subprocess.Popen[bytes]:
    """A process of the job, its output in ``out/<name>.log``, in a session of its own
    (a node's tree is killed whole)."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE), **env}
    with open(out / f"{name}.log", "ab") as log:
        return subprocess.Popen(
            cmd, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and everything below it, as a machine that loses power."""
    procs.kill_tree(proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
