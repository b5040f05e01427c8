"""`unbroken run`: faults injected into a real torchrun job (2 gloo ranks, CPU) that must
finish with parameters bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import unbroken.run
from unbroken.run import contract, faults, worker
from unbroken.run.args import parse, split_argv
from unbroken.run.faults import Fault
from unbroken.run.timeline import Timeline

STEPS = 24
SAVE_EVERY = 10

TRAIN = Path(__file__).with_name("train_job.py")


def launch(tmp: Path, *options: str, env: dict[str, str] | None = None, replicas: int = 0) -> dict:
    """`python -m unbroken.run OPTIONS train_job.py`; its timeline, final parameters and
    the start records the workers wrote."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "out"
    out.mkdir()
    timeline = tmp / "timeline.json"
    cmd = [
        sys.executable,
        "-m",
        "unbroken.run",
        f"--timeline-json={timeline}",
        *options,
        "--max-restarts=2",
        "--monitor-interval=0.1",
        str(TRAIN),
        f"--ckpt={tmp / 'ckpt'}",
        f"--out={out}",
        f"--steps={STEPS}",
        f"--save-every={SAVE_EVERY}",
        f"--replicas={replicas}",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        "seconds": time.monotonic() - t0,
        "stderr": proc.stderr,
        "timeline": json.loads(timeline.read_text()),
        "params": [(out / f"final-{r}.bin").read_bytes() for r in range(2)],
        "starts": [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = launch(tmp_path_factory.mktemp("reference"), "--standalone", "--nproc-per-node=2")
    assert run["timeline"]["recoveries"] == []
    assert run["params"][0] == run["params"][1]  # DDP: the ranks agree
    return run


def restarts(run: dict) -> list[dict]:
    """The starts that restored something: rank, attempt, node, the step, and its source
    ("memory": this rank's state came from shared memory, its own or a peer's replica)."""
    return [
        {k: s[k] for k in ("rank", "attempt", "node", "restored")} | {"source": source(s)}
        for s in run["starts"]
        if s["restored"] is not None
    ]


def source(start: dict) -> str:
    return "storage" if start["origins"][start["rank"]] == "storage" else "memory"


@pytest.mark.timeout(90)
def test_killed_rank_recovers_from_memory_bitwise(tmp_path, reference):
    step = random.Random().randint(3, STEPS - 2)
    # The agent shares its store with the workers across attempts here (torchrun's
    # default): the restarted attempt must get through init on its own key prefix.
    run = launch(
        tmp_path,
        "--standalone",
        "--nproc-per-node=2",
        f"--inject-fault=kill rank=1 step={step}",
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"},
    )
    assert run["params"] == reference["params"], f"killed at step {step}"
    # tick() comes before snapshot(): the newest snapshot is the step before the kill.
    assert sorted(restarts(run), key=lambda s: s["rank"]) == [
        {"rank": r, "attempt": 1, "node": None, "restored": step - 1, "source": "memory"}
        for r in (0, 1)
    ]
    events = run["timeline"]["events"]
    prefixes = {e["prefix"] for e in events if e["event"] == "init_done" and e["attempt"] == 1}
    assert prefixes == {"unbroken/attempt-1"}
    [rec] = run["timeline"]["recoveries"]
    assert rec["fault"] == f"kill rank=1 step={step}" and rec["fault_step"] == step
    assert rec["detected_by"] == "worker_exit"
    assert rec["fault_t"] <= rec["detected_t"] <= rec["restart_t"] <= rec["ready_t"]
    assert rec["ready_t"] <= rec["first_step_t"]
    assert rec["first_step"] == step and rec["steps_redone"] == 1
    print(f"kill at step {step}: recovery {rec['recovery_s']:.2f} s, run {run['seconds']:.1f} s")


@pytest.mark.timeout(90)
def test_hang_is_detected_within_the_timeout(tmp_path, reference):
    timeout = 3.0
    run = launch(
        tmp_path,
        "--standalone",
        "--nproc-per-node=2",
        "--inject-fault=hang rank=0 step=8",
        f"--heartbeat-timeout={timeout}",
    )
    assert run["params"] == reference["params"]
    [rec] = run["timeline"]["recoveries"]
    assert rec["detected_by"] == "hang_detected"
    # The heartbeat is at most 0.2 s old when the hang starts; the watchdog polls often.
    assert timeout - 0.5 < rec["detected_t"] - rec["fault_t"] < timeout + 1.0
    assert "made no progress" in run["stderr"]
    assert {s["source"] for s in restarts(run)} == {"memory"}
    print(f"hang detected after {rec['detected_t'] - rec['fault_t']:.2f} s")


@pytest.mark.timeout(90)
def test_killed_node_is_replaced_and_the_run_finishes_bitwise(tmp_path, reference):
    run = launch(
        tmp_path,
        "--simulate-nodes=2",
        "--nproc-per-node=1",
        "--inject-fault=kill-node node=1 step=14",
        replicas=1,
    )
    assert run["params"] == reference["params"]
    names = [e["event"] for e in run["timeline"]["events"]]
    for name in ("node_kill_requested", "node_killed", "node_replaced"):
        assert name in names
    # Node 1's shared memory is gone, but rank 0 on node 0 holds a replica of one of its
    # snapshots: nobody goes back to storage's step 10. Step 13's snapshot is copied at
    # step 14's optimizer step (overlapped), so under load its replica may still be on
    # its way when the kill at step 14 lands: then both restore step 12, together.
    again = restarts(run)
    assert {s["rank"] for s in again} == {0, 1}
    [(restored, source)] = {(s["restored"], s["source"]) for s in again}
    assert source == "memory" and restored in (12, 13), (restored, source)
    assert next(s for s in again if s["rank"] == 1)["node"] == "1"  # node i keeps its ranks
    [rec] = run["timeline"]["recoveries"]
    print(f"node loss: recovery {rec['recovery_s']:.2f} s")


# -- fault specs and the command line ---------------------------------------------------


def test_a_training_script_finds_its_calls_in_unbroken_run():
    from unbroken.run import inprocess

    assert sorted(unbroken.run.__all__) == sorted(
        ["init_process_group", "tick", "event", "in_process", "InProcessError"]
    )
    assert unbroken.run.tick is worker.tick and unbroken.run.in_process is inprocess.in_process
    assert unbroken.run.init_process_group is worker.init_process_group
    assert issubclass(unbroken.run.InProcessError, RuntimeError)


def test_fault_specs_parse():
    assert faults.parse("kill rank=1 step=40; hang rank=0 step=60 ;kill-node node=1 step=80") == [
        Fault("kill", 1, 40, 0),
        Fault("hang", 0, 60, 1),
        Fault("kill-node", 1, 80, 2),
    ]
    assert faults.parse("") == [] and faults.parse(" ; ") == []
    assert str(Fault("kill-node", 1, 80)) == "kill-node node=1 step=80"


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("explode rank=1 step=2", "unknown kind 'explode'"),
        ("kill rank=1", "missing step="),
        ("kill step=3", "missing rank="),
        ("kill rank=one step=3", "'rank=one' is not key=N"),
        ("kill rank=-1 step=3", "'rank=-1' is not key=N"),
        ("kill node=1 step=3", "kill takes rank= and step=, not node="),
        ("kill-node rank=1 step=3", "kill-node takes node= and step=, not rank="),
        ("hang rank=1 step=3 step=4", "step= given twice"),
        ("kill rank=1 step=3; kill rank 2", "'rank' is not key=N"),
    ],
)
def test_fault_spec_errors_name_the_bad_text(spec, complaint):
    with pytest.raises(ValueError) as e:
        faults.parse(spec)
    assert complaint in str(e.value)
    assert "bad fault" in str(e.value) and "kill rank=1 step=40" in str(e.value)


def test_arguments_split_between_unbroken_torchrun_and_the_script():
    ours, torchrun, script = split_argv(
        [
            "--inject-fault",
            "kill rank=1 step=4",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--heartbeat-timeout=5",
            "--max_restarts=3",
            "train.py",
            "--inject-fault",
            "x",
        ]
    )
    assert ours == ["--inject-fault", "kill rank=1 step=4", "--heartbeat-timeout=5"]
    assert torchrun == ["--standalone", "--nproc-per-node", "2", "--max_restarts=3"]
    assert script == ["train.py", "--inject-fault", "x"]  # the script's own, untouched


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--inject-fault=kill rank=1", "t.py"], "missing step="),
        (["--inject-fault=kill rank=1 step=3", "t.py"], "needs --max-restarts 1 or more"),
        (["--max-restarts=1", "--inject-fault=kill-node node=0 step=3", "t.py"], "--simulate"),
        (
            ["--max-restarts=1", "--nproc-per-node=2", "--inject-fault=kill rank=2 step=3", "t.py"],
            "no such rank",
        ),
        (["--simulate-nodes=2", "--max-restarts=1", "--standalone", "t.py"], "--standalone"),
        (["--simulate-nodes=2", "t.py"], "needs --max-restarts"),
        (["--standalone"], "no training script"),
    ],
)
def test_bad_command_lines_are_refused_clearly(argv, complaint, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert complaint in capsys.readouterr().err


def test_tick_is_cheap_and_writes_a_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setenv(contract.HEARTBEAT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(contract.FAULT_ENV, "kill rank=1 step=1")  # another rank's
    worker.reset()
    try:
        unbroken.run.tick(1)
        t0 = time.perf_counter()
        for step in range(2, 100_002):
            unbroken.run.tick(step)
        per_tick = (time.perf_counter() - t0) / 100_000
        step, _, pid, attempt = (tmp_path / "rank-3").read_text().split()
        assert int(pid) == os.getpid() and attempt == "0" and int(step) >= 1
        assert per_tick < 20e-6, f"{per_tick * 1e6:.1f} us per tick"
    finally:
        worker.reset()


def test_timeline_gives_each_fault_its_own_recovery():
    tl = Timeline(t0=0.0)

    def worker(pid: int, start: float, step: int) -> None:
        tl.add("process_start", t=start, pid=pid, process_start=start)
        tl.add("init_done", t=start + 1, pid=pid)
        tl.add("first_step", t=start + 2, pid=pid, step=step)

    worker(1, 0.0, 1)
    tl.add("fault", t=10.0, spec="kill rank=0 step=40", step=40)
    tl.add("worker_exit", t=10.1, pid=1)
    worker(2, 12.0, 39)  # the restart after the first fault
    tl.add("fault", t=20.0, spec="kill-node node=0 step=70", step=70)
    tl.add("node_kill_requested", t=20.05)
    worker(3, 23.0, 66)  # the replacement after the second
    first, second = tl.recoveries()
    assert (first["restart_t"], first["first_step_t"], first["steps_redone"]) == (12.0, 14.0, 2)
    assert (second["restart_t"], second["first_step_t"], second["steps_redone"]) == (23.0, 25.0, 5)
    assert (first["detected_by"], second["detected_by"]) == ("worker_exit", "node_kill_requested")


def _other_addresses() -> list[str]:
    """Addresses of this machine other than 127.0.0.1: 127.0.0.2 (loopback too, so a
    socket listening on every interface answers it) and the outward one if there is."""
    found = ["127.0.0.2"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent: only the route is looked up
            if not s.getsockname()[0].startswith("127."):
                found.append(s.getsockname()[0])
        except OSError:
            pass
    return found


@pytest.mark.timeout(30)
def test_the_launchers_store_listens_on_loopback_only():
    """torch's TCPStore master listens on every interface and has no authentication;
    the launcher's store (`unbroken.run.listen.store`) listens on 127.0.0.1 alone: a
    client on any other address is refused, and the job's own clients are unaffected."""
    import torch.distributed as dist

    from unbroken.run import listen

    store = listen.store(timeout=5)
    store.set("unbroken/generation", "7")
    for address in _other_addresses():
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, store.port), timeout=2).close()
        with pytest.raises(RuntimeError):  # torch's own client, refused the same way
            dist.TCPStore(address, store.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=1))  # fmt: skip
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=5))  # fmt: skip
    assert client.get("unbroken/generation") == b"7"
    with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:"):
        listen.store("127.0.0.1", store.port)  # taken: the error names the address


class _Counted:
    """A store whose requests are counted."""

    def __init__(self, store: Any) -> None:
        self.store, self.n = store, 0

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return call(*args, **kwargs)

        return counted


@pytest.mark.timeout(30)
def test_the_idle_coordinator_waits_for_announcements_yet_acts_on_a_report_at_once():
    """At idle the coordinator looks at the store every `look_s` (not every poll), reads
    the agents' beats in one request every `silence.look_s` (`unbroken.run.silence`), and
    a worker's report of a lost peer, announced (`unbroken.run.news`), still reaches it
    within a poll or two: it pings the agents at once."""
    from unbroken.run import contract, coordinator, listen
    from unbroken.run.news import Listener, announce

    raw = listen.store(timeout=10)
    raw.add(contract.GENERATION_KEY, 0)
    raw.set(contract.JOB_KEY, json.dumps({"nnodes": 2, "nproc_per_node": 1}))
    for slot in range(2):
        raw.set(contract.slot_key(slot, "owner"), f"agent{slot}")
    store = _Counted(raw)
    coord = coordinator.Coordinator(store, node_timeout=2.0)
    coord.news = Listener("127.0.0.1", raw.port)
    try:
        while not coord.started:
            coord.poll()
        idle_from, start = store.n, time.monotonic()
        while time.monotonic() - start < 1.0:
            for slot in range(2):  # the agents beat
                raw.add(contract.agent_beat_key(f"agent{slot}"), 1)
            coord.poll()
            time.sleep(coordinator.POLL_S)
        looks = 1.0 / coord.look_s + 1
        feels = 1.0 / coord.silence.look_s + 1  # the beats, all in one request each time
        assert store.n - idle_from <= looks * 12 + feels, store.n - idle_from  # ~10 a look
        assert coord.suspected is None
        raw.append(f"{contract.SUSPECT_KEY}-0", "1,")
        announce(raw)
        reported = time.monotonic()
        while coord.suspected is None and time.monotonic() - reported < 0.3:
            coord.poll()
            time.sleep(0.005)
        assert coord.suspected is not None, "the announced report was not seen in 0.3 s"
        assert raw.check([f"{contract.AGENT_PREFIX}agent0/{contract.PING_SUFFIX}-1"])
    finally:
        coord.news.stop(raw)
