"""Multi-node ``unbroken run --in-process``: an ``unbroken coordinator`` and two node agents
(2 ranks each), each agent a process tree of its own with its own shared-memory
directory, talking to the others only over TCP on loopback; nothing is shared between the
"nodes" but the checkpoint storage (and the test's output folder). A lost node is
replaced by a new agent started by the test, as Kubernetes would start a new pod: it asks
the coordinator for the free node slot. The job heals from live replicas (train_job.py
--heal: ``ckpt.step`` each step) where it can, from snapshots where it cannot. Every case
ends bitwise equal to an uninterrupted run, and every rank not lost keeps its process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

STEPS = 24
SAVE_EVERY = 10
NODES, LOCAL = 2, 2
TRAIN = Path(__file__).with_name("train_job.py")
# The coordinator and the agents share a secret: every store connection passes the gate.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_JOB_SECRET": secrets.token_hex(32)}


def log_fd(path: Path) -> int:
    """A file for a child's stderr (the child keeps it open; the caller closes its own)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


class Cluster:
    """A coordinator and the node agents of one job, all on loopback. The agents take
    warm spares (``--warm-spare``), as the storm's (c) runs: each node's ranks are forked
    from one process that imported torch, not one import per rank (this file: 151 s ->
    133 s here); ``warm=False`` starts every rank cold."""

    def __init__(self, tmp: Path, *options: str, steps: int = STEPS, warm: bool = True) -> None:
        self.tmp, self.steps = tmp, steps
        self.options = ("--warm-spare", *options) if warm else options
        self.job = f"mn-{uuid.uuid4().hex[:8]}"
        self.out = tmp / "out"
        self.out.mkdir(parents=True)
        self.shm: list[Path] = []
        self.agents: list[subprocess.Popen[bytes]] = []
        self.coordinators: list[subprocess.Popen[str]] = []
        self.coordinator = self.coordinate()

    def coordinate(self) -> subprocess.Popen[str]:
        """Start the job's coordinator; set `endpoint`, the nodes' --rdzv-endpoint."""
        coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "unbroken", "coordinator", "--host=127.0.0.1"),
                *("--port=0", "--node-timeout=1.5", "--exit-when-done"),
            ],
            stdout=subprocess.PIPE,
            stderr=(err := log_fd(self.tmp / "coordinator.err")),
            text=True,
            env=ENV,
            start_new_session=True,
        )
        os.close(err)
        assert coordinator.stdout is not None
        line = coordinator.stdout.readline()
        assert "listening on" in line, line
        self.port = int(line.rsplit(":", 1)[1])
        self.endpoint = f"127.0.0.1:{self.port}"
        self.coordinators.append(coordinator)
        return coordinator

    def agent(self, node: int | None) -> subprocess.Popen[bytes]:
        """Start a node agent: ``node`` is its --node-rank, None to take a free slot."""
        shm = Path(f"/dev/shm/unbroken-test-{self.job}-{len(self.agents)}")
        self.shm.append(shm)
        cmd = [
            sys.executable,
            "-m",
            "unbroken.run",
            "--in-process",
            f"--nnodes={NODES}",
            f"--nproc-per-node={LOCAL}",
            *([f"--node-rank={node}"] if node is not None else []),
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.job}",
            "--max-restarts=3",
            *self.options,
            str(TRAIN),
            "--in-process",
            "--heal",
            f"--ckpt={self.tmp / 'ckpt'}",
            f"--out={self.out}",
            f"--steps={self.steps}",
            f"--save-every={SAVE_EVERY}",
            "--replicas=1",
        ]
        err = log_fd(self.tmp / f"agent-{len(self.agents)}.err")
        # Its own run directory: heartbeats and events of this node only.
        env = {**ENV, "UNBROKEN_MEMORY_DIR": str(shm), "UNBROKEN_RUN_DIR": str(self.run_dir())}
        proc = subprocess.Popen(cmd, env=env, stderr=err, start_new_session=True)
        os.close(err)
        self.agents.append(proc)
        return proc

    def run_dir(self, agent: int | None = None) -> Path:
        """Agent ``agent``'s run directory (None: the next agent's)."""
        return self.tmp / f"run-dir-{len(self.agents) if agent is None else agent}"

    def starts(self) -> list[dict]:
        path = self.out / "starts.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, what: object, timeout: float = 45.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"timed out waiting: {self.log()}"
            time.sleep(0.05)

    def finish(self) -> dict:
        for proc in self.agents:
            code = proc.wait(timeout=60)
            assert code in (0, -signal.SIGKILL), f"agent exited {code}: {self.log()}"
        assert self.coordinator.wait(timeout=10) == 0, self.log()
        return {
            "params": [(self.out / f"final-{r}.bin").read_bytes() for r in range(NODES * LOCAL)],
            "starts": self.starts(),
        }

    def log(self) -> str:
        """The tail of every process's stderr, for a failure's message."""
        return "\n".join(
            f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.tmp.glob("*.err"))
        )

    def text(self) -> str:
        """Every process's stderr whole, for what a test looks for in it: native
        libraries (triton's bindings) print pages at exit, past any tail."""
        return "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(self.tmp.glob("*.err")))

    def close(self) -> None:
        """Kill every process of the test, whole trees, stopped ones too (they get
        SIGCONT first, so that none is left behind stopped)."""
        from unbroken.run.procs import descendants, kill_tree

        procs: list[subprocess.Popen[Any]] = [*self.coordinators, *self.agents]
        for proc in procs:
            if proc.poll() is None:
                for pid in [proc.pid, *descendants(proc.pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                kill_tree(proc.pid)
                proc.wait()
        for shm in self.shm:
            shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[type[Cluster]]:
    made: list[Cluster] = []

    def make(*options: str, warm: bool = True) -> Cluster:
        made.append(Cluster(tmp_path / f"run-{len(made)}", *options, warm=warm))
        return made[-1]

    yield make  # type: ignore[misc]
    for c in made:
        c.close()


def run_plain(c: Cluster) -> dict:
    c.agent(0)
    c.agent(1)
    return c.finish()


def check(run: dict, reference: dict, replaced: set[int], healed: bool = True) -> None:
    """Bitwise equal to the uninterrupted run; ranks not in ``replaced`` kept their pid,
    the replaced ones got a new one; no start after a fault went back to storage, and
    with ``healed`` every one healed from live replicas (no rollback)."""
    for rank in range(NODES * LOCAL):
        pids = [s["pid"] for s in run["starts"] if s["rank"] == rank]
        if rank in replaced:
            assert len(set(pids)) >= 2, f"rank {rank} was not replaced: {pids}"
        else:
            assert len(set(pids)) == 1 and len(pids) >= 2, f"rank {rank} changed pid: {pids}"
    later = [s for s in run["starts"] if s["seen_generation"] > 0]
    assert later and all(s["origins"] and "storage" not in s["origins"] for s in later), later
    if healed:
        assert all(set(s["origins"]) == {"live"} for s in later), later
    assert run["params"] == reference["params"], "not bitwise equal to the uninterrupted run"


def lose_node(c: Cluster, node: int, then: object = None) -> None:
    """Wait for agent ``node`` to die of its kill-node fault, optionally do ``then``,
    and start a replacement agent that asks the coordinator for the free slot."""
    c.wait_for(lambda: c.agents[node].poll() is not None)
    assert c.agents[node].returncode == -signal.SIGKILL
    if then is not None:
        then()  # type: ignore[operator]
    c.agent(None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("node", [0, 1], ids=["node-with-rank-0", "other-node"])
def test_lost_node_is_replaced_in_process_bitwise(cluster, reference, node):
    c = cluster(f"--inject-fault=kill-node node={node} step=11")
    c.agent(0)
    c.agent(1)
    lose_node(c, node)
    run = c.finish()
    check(run, reference, replaced={node * LOCAL, node * LOCAL + 1})
    new = [s for s in run["starts"] if s["seen_generation"] > 0 and s["rank"] // LOCAL == node]
    assert {s["node"] for s in new} == {str(node)}, "the replacement took the lost slot"


@pytest.mark.timeout(120)
def test_hung_rank_is_found_and_replaced_in_process_bitwise(cluster, reference):
    c = cluster("--heartbeat-timeout=3", "--inject-fault=hang rank=2 step=9")
    run = run_plain(c)
    check(run, reference, replaced={2})
    log = c.text()
    assert "made no progress" in log, c.log()  # found by its heartbeats
    # Killed when it did not answer the abort; or, when the abort reached a collective
    # its background thread was in, ended by gloo first (seen once in CI).
    assert "did not answer the abort" in log or re.search(r"rank 2 \(pid \d+\) exited", log), (
        c.log()
    )


@pytest.mark.timeout(150)
def test_survivors_wait_for_a_slow_replacement_without_a_false_hang(cluster, reference):
    """Node 1 is lost and its replacement comes only after 4 heartbeat timeouts (a new
    pod on a real cluster takes minutes): the survivors hold their state and wait,
    beating, so no watchdog calls them hung and none is restarted; the job heals from
    live replicas, bitwise. Cold: the replacement's ranks each import torch as they start."""
    c = cluster("--heartbeat-timeout=2", "--inject-fault=kill-node node=1 step=11", warm=False)
    c.agent(0)
    c.agent(1)
    lose_node(c, 1, then=lambda: time.sleep(8.0))
    run = c.finish()
    check(run, reference, replaced={2, 3})
    log = c.text()
    assert "made no progress" not in log and "did not answer the abort" not in log, c.log()


@pytest.mark.timeout(120)
def test_two_faults_in_a_row_bitwise(cluster, reference):
    c = cluster("--inject-fault=kill rank=1 step=7; kill rank=2 step=15")
    run = run_plain(c)
    check(run, reference, replaced={1, 2})
    assert max(s["seen_generation"] for s in run["starts"]) == 2


@pytest.mark.timeout(120)
def test_fault_during_recovery_bitwise(cluster, reference):
    """Node 1 is lost; before its replacement joins, rank 0 (node 0) dies too: the next
    generation replaces ranks 0, 2 and 3, and rank 1 keeps its process. Cold: every rank
    starts as a process of its own."""
    c = cluster("--inject-fault=kill-node node=1 step=11", warm=False)
    c.agent(0)
    c.agent(1)

    def kill_rank0() -> None:
        os.kill(next(s["pid"] for s in c.starts() if s["rank"] == 0), signal.SIGKILL)

    lose_node(c, 1, then=kill_rank0)
    run = c.finish()
    # Rank 1 alone is live; rank 0's record was held on the lost node: no exact heal,
    # so every rank rolls back to the last snapshot (memory and replicas, not storage).
    check(run, reference, replaced={0, 2, 3}, healed=False)


# -- the pieces, fast: the coordinator's decisions on a real store, the command lines


def test_coordinator_starts_generations_and_frees_a_silent_nodes_slot():
    import torch.distributed as dist

    from unbroken.run import contract
    from unbroken.run.coordinator import Coordinator

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.add(contract.GENERATION_KEY, 0)
    co = Coordinator(store, node_timeout=0.3)
    store.set(contract.JOB_KEY, json.dumps({"nnodes": 2, "nproc_per_node": 2}))

    def spawn(g: int, agent: str) -> list[int] | None:
        key = contract.generation_key(g, contract.SPAWN_KEY, agent)
        return json.loads(store.get(key)) if store.check([key]) else None

    def beat(*agents: str) -> None:
        for a in agents:
            store.add(contract.agent_beat_key(a), 1)
        time.sleep(co.look_s)  # nothing is announced here: seen at the next look
        co.poll()

    store.set(contract.slot_key(0, "owner"), "a")
    beat("a")
    assert spawn(0, "a") is None  # generation 0 waits for every node
    store.set(contract.slot_key(1, "owner"), "b")
    beat("a", "b")
    assert (spawn(0, "a"), spawn(0, "b")) == ([0, 1], [2, 3])
    # Rank 1 fails: node a aborts and settles, b settles with nothing lost.
    store.set(f"{contract.ABORT_KEY}-0", json.dumps({"failed": [1]}))
    store.set(contract.generation_key(0, contract.SETTLED_KEY, "a"), "[1]")
    beat("a", "b")
    assert int(store.add(contract.GENERATION_KEY, 0)) == 0  # b has not settled yet
    store.set(contract.generation_key(0, contract.SETTLED_KEY, "b"), "[]")
    beat("a", "b")
    assert int(store.add(contract.GENERATION_KEY, 0)) == 1
    assert (spawn(1, "a"), spawn(1, "b")) == ([1], [])
    # Node b goes silent: its slot is freed and generation 1 aborted; a new agent takes
    # the slot and is told to start all of its ranks in generation 2.
    deadline = time.monotonic() + 5
    while store.check([contract.slot_key(1, "owner")]):
        assert time.monotonic() < deadline
        beat("a")
        time.sleep(0.05)
    assert json.loads(store.get(f"{contract.ABORT_KEY}-1"))["failed"] == [2, 3]
    store.set(contract.generation_key(1, contract.SETTLED_KEY, "a"), "[]")
    beat("a")
    assert int(store.add(contract.GENERATION_KEY, 0)) == 1  # no agent on slot 1 yet
    assert store.compare_set(contract.slot_key(1, "owner"), "", "c").decode() == "c"
    beat("a", "c")
    assert int(store.add(contract.GENERATION_KEY, 0)) == 2
    assert (spawn(2, "a"), spawn(2, "c")) == ([], [2, 3])


def test_a_worker_report_finds_the_lost_node_by_ping_long_before_its_node_timeout():
    import torch.distributed as dist

    from unbroken.run import contract
    from unbroken.run.coordinator import Coordinator
    from unbroken.run.silence import Silence

    store: Any = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.add(contract.GENERATION_KEY, 0)
    # Neither the node timeout nor a beat's silence (unbroken.run.silence) is tested here.
    co = Coordinator(
        store, node_timeout=30.0, suspect_timeout=0.2, silence=Silence(ping_after_s=30)
    )
    store.set(contract.JOB_KEY, json.dumps({"nnodes": 3, "nproc_per_node": 2}))
    for slot, agent in enumerate("abc"):
        store.set(contract.slot_key(slot, "owner"), agent)
        store.add(contract.agent_beat_key(agent), 1)
    co.poll()
    assert co.started

    def pinged(agent: str) -> bool:
        return store.check([f"{contract.AGENT_PREFIX}{agent}/{contract.PING_SUFFIX}-1"])

    # Rank 1 (node 0) saw a peer vanish: every agent is pinged; b answers, c does not,
    # and node 0 is vouched for by its reporting rank.
    store.append(f"{contract.SUSPECT_KEY}-0", "1,")
    time.sleep(co.look_s)  # not announced here (the idle test below announces): next look
    co.poll()
    assert all(pinged(a) for a in "abc")
    store.add(contract.agent_beat_key("b"), 1)
    co.poll()
    assert store.check([contract.slot_key(2, "owner")])  # not before --suspect-timeout
    time.sleep(0.25)
    co.poll()
    owners = [store.check([contract.slot_key(s, "owner")]) for s in range(3)]
    assert owners == [True, True, False]
    assert json.loads(store.get(f"{contract.ABORT_KEY}-0"))["failed"] == [4, 5]


def test_restart_all_across_nodes_gets_short_rendezvous_keep_alives():
    from unbroken.run.launch import with_keep_alive

    merged = with_keep_alive(["--nnodes", "2", "--rdzv-conf", "keep_alive_interval=3"])
    assert merged == ["--nnodes=2", "--rdzv-conf=keep_alive_interval=3,keep_alive_max_attempt=2"]
    assert with_keep_alive(["--nnodes=1", "--nproc-per-node=2"]) == [
        "--nnodes=1",
        "--nproc-per-node=2",
    ]


def test_in_process_across_nodes_needs_a_coordinator(capsys):
    from unbroken.run.args import check_in_process, multi_node, parse

    base = ["--in-process", "--nnodes=2", "--nproc-per-node=2", "--max-restarts=1"]
    ok = parse([*base, "--node-rank=1", "--rdzv-endpoint=h:29400", str(TRAIN)])
    assert multi_node(ok) and check_in_process(ok).node_rank == 1
    with pytest.raises(SystemExit):
        check_in_process(parse([*base, str(TRAIN)]))
    assert "unbroken coordinator" in capsys.readouterr().err
