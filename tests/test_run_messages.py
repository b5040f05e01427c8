"""Clear messages from a multi-node ``unbroken run --in-process`` (issue 32, item 7; the
stores' binding, item 6, is tests/test_run_bound.py).

The messages are read from real launches: an ``unbroken coordinator`` and node agents on
loopback, each agent a process tree of its own, with the job's secret (every store
connection passes the gate and the node's relay).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_JOB_SECRET": secrets.token_hex(32)}

# An in-process job: BOUND_STEPS all-reduces of one number, a tick each.
STEPS = """
import os, time
import torch
import torch.distributed as dist
import unbroken.run

def train():
    for step in range(int(os.environ.get("BOUND_STEPS", "30"))):
        dist.all_reduce(torch.ones(1))
        unbroken.run.tick(step)
        time.sleep(0.05)

unbroken.run.in_process(train)
"""


class Cluster:
    """An ``unbroken coordinator`` and node agents of one tiny in-process job (`STEPS`),
    on loopback, each agent a process tree with its stderr in a file of its own."""

    def __init__(self, tmp: Path, exit_when_done: bool = True) -> None:
        self.tmp = tmp
        (tmp / "steps.py").write_text(textwrap.dedent(STEPS))
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        cmd = [sys.executable, "-m", "unbroken", "coordinator", "--host=127.0.0.1", "--port=0"]
        with open(tmp / "coordinator.err", "w") as err:
            self.coordinator = subprocess.Popen(
                [*cmd, "--node-timeout=1.5", *(["--exit-when-done"] if exit_when_done else [])],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=ENV,
                start_new_session=True,
            )
        assert self.coordinator.stdout is not None
        line = self.coordinator.stdout.readline()
        assert "listening on" in line, line
        self.port = int(line.rsplit(":", 1)[1])

    def agent(
        self, name: str, *options: str, host: str = "127.0.0.1", steps: int = 30, nproc: int = 1
    ) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "unbroken.run",
            "--in-process",
            "--nnodes=2",
            f"--nproc-per-node={nproc}",
            f"--rdzv-endpoint={host}:{self.port}",
            "--rdzv-id=bound",
            "--max-restarts=3",
            *options,
            str(self.tmp / "steps.py"),
        ]
        env = {**ENV, "BOUND_STEPS": str(steps), "UNBROKEN_MEMORY_DIR": str(self.tmp / name)}
        with open(self.tmp / f"{name}.err", "w") as err:
            proc = subprocess.Popen(cmd, env=env, stderr=err, start_new_session=True)
        self.agents[name] = proc
        return proc

    def err(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def wait_for(self, what: Callable[[], bool], timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "\n".join(
                f"== {p.name}\n{p.read_text()[-2000:]}" for p in self.tmp.glob("*.err")
            )
            time.sleep(0.05)

    def close(self) -> None:
        procs: list[subprocess.Popen[Any]] = [self.coordinator, *self.agents.values()]
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[list[Cluster]]:
    made: list[Cluster] = []
    yield made
    for c in made:
        c.close()


@pytest.mark.timeout(90)
def test_a_surviving_node_names_the_lost_node_in_its_summary(tmp_path, clusters):
    clusters.append(c := Cluster(tmp_path))
    fault = "--inject-fault=kill-node node=1 step=5"
    survivor = c.agent("node-0", "--node-rank=0", fault)
    lost = c.agent("node-1", "--node-rank=1", fault)
    c.wait_for(lambda: lost.poll() is not None)
    assert lost.returncode == -signal.SIGKILL
    replacement = c.agent("replacement")  # takes the free slot, as a new pod would
    for proc in (survivor, replacement):
        assert proc.wait(timeout=60) == 0, c.err("node-0") + c.err("replacement")
    summary = c.err("node-0").split("timeline (seconds since launch)")[1]
    assert "real failure: node 1 lost" in summary, summary
    assert "no fault was injected" not in summary, summary


@pytest.mark.parametrize(
    "reason, named",
    [
        ({"failed": [2, 3], "node": 1, "hang": False, "lost": "silent for 2.1 s"}, "node 1 lost"),
        ({"failed": [3], "node": 1, "hang": False}, "ranks [3] of node 1 failed"),
        ({"failed": [], "node": 1, "hang": True}, "a rank of node 1 hung"),
    ],
)
def test_the_summary_names_another_nodes_failure_dated_where_a_rank_saw_it(reason, named):
    from unbroken.run.timeline import Timeline

    t = Timeline(mode="in-process")
    t.record("first_step", None, t.t0 + 1.0, rank=0, pid=5, step=0, attempt=0)
    t.last_step[5] = (6, t.t0 + 1.8)
    t.record("peer_failure", None, t.t0 + 2.0, rank=0, pid=5, attempt=0)
    t.remote_failure(reason, 0)  # the agent sees the abort later, at 2.5 s say
    t.record("generation", None, t.t0 + 2.6, generation=1)
    t.record("first_step", None, t.t0 + 3.0, rank=0, pid=5, step=7, attempt=1)
    t.add("done", exit_code=0)
    summary = t.summary()
    assert f"real failure: {named} at step 6" in summary, summary
    assert "no failure" not in summary
    (recovery,) = t.recoveries()
    assert recovery["fault_t"] == 2.0 and recovery["recovery_s"] == 1.0


@pytest.mark.timeout(60)
def test_errors_name_the_coordinator_as_given_not_the_nodes_relay(tmp_path, clusters):
    """A node of another job's shape, and a node that loses the coordinator: both name
    ``localhost:PORT``, as the user wrote it, not the relay's 127.0.0.1 port."""
    clusters.append(c := Cluster(tmp_path, exit_when_done=False))
    given = f"localhost:{c.port}"
    first = c.agent("first", "--node-rank=0", host="localhost")
    c.wait_for(lambda: "node agent" in c.err("first"))  # joined: waits for node 1
    other = c.agent("other", "--node-rank=1", host="localhost", nproc=2)
    c.wait_for(lambda: other.poll() is not None)
    assert other.returncode != 0
    assert f"the coordinator at {given} runs a job of" in c.err("other"), c.err("other")
    os.killpg(c.coordinator.pid, signal.SIGKILL)
    c.wait_for(lambda: first.poll() is not None)
    assert first.returncode != 0
    assert f"lost the coordinator at {given} (" in c.err("first"), c.err("first")
    assert "Traceback" not in c.err("first") + c.err("other")


@pytest.mark.timeout(60)
def test_a_standby_that_loses_the_coordinator_says_so_in_one_line(tmp_path, clusters):
    """A warm-spare standby waiting for a node slot when the coordinator dies: one line
    naming the coordinator and what to do; no traceback from it or its spare."""
    clusters.append(c := Cluster(tmp_path, exit_when_done=False))
    for node in (0, 1):
        c.agent(f"node-{node}", f"--node-rank={node}", steps=100000)
    c.wait_for(lambda: all("node agent" in c.err(f"node-{n}") for n in (0, 1)))
    standby = c.agent("standby", "--warm-spare")
    c.wait_for(lambda: "waiting for one to be free" in c.err("standby"))
    time.sleep(1.0)  # its spare imports torch and joins the store meanwhile
    os.killpg(c.coordinator.pid, signal.SIGKILL)
    c.wait_for(lambda: standby.poll() is not None)
    err = c.err("standby")
    assert standby.returncode == 1 and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("unbroken run: lost the coordinator")]
    assert len(lines) == 1 and f"at 127.0.0.1:{c.port} " in lines[0], err
    assert "restart `unbroken coordinator` there" in lines[0]


@pytest.mark.timeout(90)
def test_an_orderly_end_is_quiet_for_spares_and_standbys(tmp_path, clusters):
    """A job that ends well, its coordinator told to exit then: the standbys waiting for
    a slot see the end and exit 0 (the coordinator waits for them), and no agent, spare,
    standby or the coordinator prints a traceback."""
    clusters.append(c := Cluster(tmp_path))
    nodes = [c.agent(f"node-{n}", f"--node-rank={n}", "--warm-spare") for n in (0, 1)]
    c.wait_for(lambda: all("node agent" in c.err(f"node-{n}") for n in (0, 1)))
    standbys = [c.agent(f"standby-{i}", "--warm-spare") for i in (0, 1)]
    for proc in [*nodes, *standbys]:
        proc.wait(timeout=60)
    assert c.coordinator.wait(timeout=20) == 0
    errs = {name: c.err(name) for name in c.agents}
    assert [p.returncode for p in nodes + standbys] == [0] * 4, errs
    assert all("the job finished while this agent waited" in errs[f"standby-{i}"] for i in (0, 1))
    errs["coordinator"] = c.err("coordinator")
    # Neither Python's tracebacks nor torch's C++ ones (a store client's broken connection).
    noisy = [n for n, err in errs.items() if "Traceback" in err or "Exception raised from" in err]
    assert not noisy, errs
