"""`unbroken run --in-process`: a failed rank is replaced while the healthy ranks keep their
processes, roll back from their own shared memory, and the run still ends with parameters
bitwise equal to an uninterrupted run (2 gloo ranks, CPU)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import PIPE

import pytest

from unbroken.run.procs import descendants, kill_tree

STEPS = 24
SAVE_EVERY = 10

TRAIN = Path(__file__).with_name("train_job.py")


def launch(
    tmp: Path,
    *options: str,
    replicas: int = 0,
    during: Callable[[subprocess.Popen[str]], None] | None = None,
    setup_s: float = 0.0,
    steps: int = STEPS,
) -> dict:
    """`python -m unbroken.run --in-process OPTIONS train_job.py --in-process`: its
    timeline, final parameters, and the records each rank wrote at the start of each
    generation (with the source of its state, see `source`). ``during`` runs on a
    thread of its own while the launcher does."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "out"
    out.mkdir()
    timeline = tmp / "timeline.json"
    cmd = [
        sys.executable,
        "-m",
        "unbroken.run",
        "--in-process",
        f"--timeline-json={timeline}",
        *options,
        "--max-restarts=2",
        str(TRAIN),
        "--in-process",
        f"--ckpt={tmp / 'ckpt'}",
        f"--out={out}",
        f"--steps={steps}",
        f"--save-every={SAVE_EVERY}",
        f"--replicas={replicas}",
        f"--setup-s={setup_s}",
    ]
    t0 = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, env=env) as proc:
        if during is not None:
            threading.Thread(target=during, args=(proc,), daemon=True).start()
        try:
            _, stderr = proc.communicate(timeout=60)
        finally:
            kill_tree(proc.pid)
    assert proc.returncode == 0, stderr[-4000:]
    return {
        "seconds": time.monotonic() - t0,
        "stderr": stderr,
        "timeline": json.loads(timeline.read_text()),
        "params": [(out / f"final-{r}.bin").read_bytes() for r in range(2)],
        "starts": [
            start | {"generation": start["attempt"], "source": source(start)}
            for start in map(json.loads, (out / "starts.jsonl").read_text().splitlines())
        ],
    }


def source(start: dict) -> str | None:
    """Where a start's state came from: "replica" if any rank of the job restored from a
    peer's replica, else this rank's source ("memory" or "storage"); None: nothing."""
    origins = start["origins"]
    if origins is None:
        return None
    return "replica" if "replica" in origins else origins[start["rank"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = launch(tmp_path_factory.mktemp("reference"), "--nproc-per-node=2")
    assert run["timeline"]["recoveries"] == []
    assert run["params"][0] == run["params"][1]  # DDP: the ranks agree
    assert {s["generation"] for s in run["starts"]} == {0}
    return run


def starts_of(run: dict, rank: int) -> list[dict]:
    return sorted(
        (s for s in run["starts"] if s["rank"] == rank), key=lambda s: s["seen_generation"]
    )


def check_recovery(
    run: dict, fault: str, step: int, replaced: int = 1, restored: int | None = None
) -> dict:
    [rec] = run["timeline"]["recoveries"]
    assert rec["fault"] == fault and rec["fault_step"] == step
    assert rec["generation"] == 1 and rec["respawned"] == [replaced]
    order = ["fault_t", "detected_t", "respawn_t", "ready_t", "restored_t", "first_step_t"]
    times = [rec[k] for k in order]
    assert None not in times and times == sorted(times), rec
    # tick() comes before snapshot(): the newest snapshot is the step before the fault.
    restored = step - 1 if restored is None else restored
    assert rec["first_step"] == restored + 1 and rec["steps_redone"] == step - restored
    return rec


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spare", [False, True], ids=["cold", "warm-spare"])
def test_killed_rank_is_replaced_in_process_bitwise(tmp_path, reference, spare):
    rng = random.Random()
    victim, step = rng.randint(0, 1), rng.randint(3, STEPS - 2)
    fault = f"kill rank={victim} step={step}"
    options = ["--nproc-per-node=2", f"--inject-fault={fault}"]
    run = launch(tmp_path, *options, *(["--warm-spare"] if spare else []))
    assert run["params"] == reference["params"], fault
    first, again = starts_of(run, 1 - victim)
    assert first["pid"] == again["pid"], "the healthy rank kept its process"
    assert (again["seen_generation"], again["restored"], again["source"]) == (1, step - 1, "memory")
    old, new = starts_of(run, victim)
    assert old["pid"] != new["pid"] and new["generation"] == 1
    assert (new["restored"], new["source"]) == (step - 1, "memory")  # its own, same node
    rec = check_recovery(run, fault, step, replaced=victim)
    assert rec["detected_by"] == "worker_exit"
    assert rec["warm_spares"] == int(spare)
    print(f"\n{fault}: {json.dumps(rec)}\nrun {run['seconds']:.1f} s")


@pytest.mark.timeout(60)
def test_killed_node_is_replaced_from_replicas_in_process_bitwise(tmp_path, reference):
    step = 14
    run = launch(
        tmp_path,
        "--simulate-nodes=2",
        "--nproc-per-node=1",
        f"--inject-fault=kill-node node=1 step={step}",
        replicas=1,
    )
    assert run["params"] == reference["params"]
    first, again = starts_of(run, 0)
    assert first["pid"] == again["pid"], "node 0's rank kept its process"
    old, new = starts_of(run, 1)
    assert old["pid"] != new["pid"] and new["node"] == "1"
    # Node 1's memory is gone: rank 1 gets its step back from rank 0's replica, rank 0 from
    # its own memory; nobody goes back to storage's step 10. The kill lands after
    # snapshot(13) returned, so that step is 13 or 12 (docs/guarantees.md): the replica
    # of 13 is still in flight when a loaded machine makes the kill first.
    assert new["source"] == "replica" and new["restored"] in (step - 1, step - 2)
    assert again["restored"] == new["restored"] and again["source"] in ("memory", "replica")
    rec = check_recovery(run, f"kill-node node=1 step={step}", step, restored=new["restored"])
    assert rec["detected_by"] == "node_kill_requested"
    print(f"\nkill-node: {json.dumps(rec)}\nrun {run['seconds']:.1f} s")


@pytest.mark.timeout(60)
def test_hung_rank_is_found_and_replaced_in_process_bitwise(tmp_path, reference):
    """Both ranks stop making progress (rank 1 waits for rank 0 in a collective); the
    supervisor aborts the generation, rank 1 answers, and only silent rank 0 is replaced."""
    step, timeout = 11, 4
    run = launch(
        tmp_path,
        "--nproc-per-node=2",
        f"--heartbeat-timeout={timeout}",
        f"--inject-fault=hang rank=0 step={step}",
    )
    assert run["params"] == reference["params"]
    first, again = starts_of(run, 1)
    assert first["pid"] == again["pid"], "the waiting rank kept its process"
    old, new = starts_of(run, 0)
    assert old["pid"] != new["pid"] and new["generation"] == 1
    [rec] = run["timeline"]["recoveries"]
    assert rec["detected_by"] == "hang_detected" and rec["respawned"] == [0]
    hung = [e for e in run["timeline"]["events"] if e["event"] == "hung"]
    assert [e["rank"] for e in hung] == [0]
    # Detected once the heartbeat is 4 s old, not at the collective's 30 s timeout.
    assert rec["detected_t"] - rec["fault_t"] < timeout + 2


@pytest.mark.timeout(90)
def test_a_hang_is_found_at_the_ranks_learned_pace_not_at_the_heartbeat_timeout(tmp_path):
    """With ``--hang-factor``, a rank that hangs once its pace is learned is found within
    a few of its heartbeat gaps (0.2 s and more here), not the 60 s heartbeat timeout;
    the saves and snapshots before it, slower steps, were no hang. The pace is learned
    from 25 beats, written at most every 0.2 s: 5 s of steps at the least, and 500 of
    train_job's steps take 10 s at the least (at 200, a quick host hung it unlearned)."""
    step, timeout = 500, 60
    options = ["--nproc-per-node=2", f"--heartbeat-timeout={timeout}", "--hang-factor=5"]
    run = launch(tmp_path, *options, f"--inject-fault=hang rank=0 step={step}", steps=step + 30)
    [rec] = run["timeline"]["recoveries"]
    assert rec["detected_by"] == "hang_detected" and rec["respawned"] == [0], rec
    assert rec["fault_step"] == step
    assert rec["detected_t"] - rec["fault_t"] < timeout / 4, rec
    assert len({s["pid"] for s in starts_of(run, 1)}) == 1, "the waiting rank kept its process"


@pytest.mark.timeout(90)
def test_a_rank_stopped_before_its_first_beat_is_found_and_replaced(tmp_path, reference):
    """A warm spare SIGSTOPped before it runs its assignment (a machine that hangs as
    its rank joins) never beats. It is judged by the beat its supervisor wrote for it
    at the assignment, a heartbeat timeout later, and replaced; it used to be judged
    never, and the healthy rank waited out every join of every generation."""
    timeout, stopped = 4, list[int]()

    def stop_the_first_spare(launcher: subprocess.Popen[str]) -> None:
        # The template forks the two ranks, then the pool's spare: the third child.
        while launcher.poll() is None and not stopped:
            for pid in descendants(launcher.pid):
                with contextlib.suppress(OSError):
                    if b"unbroken.run.spare" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        forked = forked_by(pid)
                        if len(forked) == 3:
                            os.kill(forked[-1], signal.SIGSTOP)
                            stopped.append(forked[-1])
            time.sleep(0.01)

    options = ["--nproc-per-node=2", "--warm-spare", f"--heartbeat-timeout={timeout}"]
    fault = "--inject-fault=kill rank=1 step=11"
    run = launch(tmp_path, *options, fault, during=stop_the_first_spare)
    assert run["params"] == reference["params"]
    [spare] = stopped
    hangs = [e for e in run["timeline"]["events"] if e["event"] == "hang_detected"]
    assert hangs and hangs[0]["ranks"] == [1], run["stderr"][-3000:]
    assert spare not in {s["pid"] for s in run["starts"]}, "the stopped spare never started"
    assert len({s["pid"] for s in starts_of(run, 0)}) == 1, "the healthy rank kept its process"
    assert len({s["pid"] for s in starts_of(run, 1)}) == 2
    recoveries = run["timeline"]["recoveries"]
    assert all(r["warm_spares"] == len(r["respawned"]) for r in recoveries), (
        "killing the stopped spare killed its template: the replacements started cold"
    )


def forked_by(template: int) -> list[int]:
    """The processes ``template`` forked, oldest first."""
    stats = {}
    for pid in descendants(template):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == template:
                stats[pid] = int(fields[19])  # its start time
    return sorted(stats, key=stats.__getitem__)


@pytest.mark.timeout(90)
def test_a_setup_longer_than_the_heartbeat_timeout_is_no_hang_in_a_rank_from_a_spare(tmp_path):
    """A rank started from a warm spare has, as a cold start has, `FIRST_STEP_S` for its
    script's setup before its first step: one judged by the heartbeat timeout alone was
    found hung at every start of a job whose setup took longer, and the generation
    aborted, killing the ranks still setting up (bench/storm.py's (c), 10 s timeout)."""
    options = ["--nproc-per-node=2", "--warm-spare", "--heartbeat-timeout=2"]
    run = launch(tmp_path, *options, "--inject-fault=kill rank=1 step=11", setup_s=5)
    assert "from a warm spare" in run["stderr"], run["stderr"][-3000:]
    hangs = [e for e in run["timeline"]["events"] if e["event"] in ("hang_detected", "hung")]
    assert not hangs, run["stderr"][-3000:]
    assert [len({s["pid"] for s in starts_of(run, r)}) for r in range(2)] == [1, 2]
