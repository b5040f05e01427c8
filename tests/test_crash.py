"""Crash consistency: a saving process SIGKILLed anywhere in the pipeline never loses a
committed step nor yields a mixed one (tests/crash_harness.py runs the single-rank trials;
the multi-rank ones, snapshots and their replicas, run here on real gloo ranks).

``--trials N`` sets how many single-rank trials run in all (2/3 on local storage, 1/3 on
S3); CI runs the default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from ranks import run_ranks, start_ranks
from unbroken import Checkpointer
from unbroken.run import faults

HARNESS = os.path.join(os.path.dirname(__file__), "crash_harness.py")


def _harness(uri: str, options: dict | None, trials: int, seed: int, timeout: float) -> dict:
    command = [sys.executable, HARNESS, "--uri", uri, "--trials", str(trials)]
    command += ["--seed", str(seed)] + (["--options", json.dumps(options)] if options else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert lines, f"the harness printed nothing; stderr:\n{done.stderr[-3000:]}"
    summary = json.loads(lines[-1])
    print(f"crash trials ({summary['uri']}): {summary}")  # the counts, in the CI log
    return summary


def _check(summary: dict, trials: int) -> None:
    assert summary["failures"] == [], summary["failures"]
    kills = summary["kills"]
    killed = sum(n for label, n in kills.items() if "not reached" not in label)
    assert sum(kills.values()) == trials and killed >= trials * 0.6, kills
    named = {label for label in kills if label in faults.POINTS}
    assert len(named) >= 6, f"too few crash points were reached: {kills}"


@pytest.mark.timeout(240)
def test_killed_anywhere_in_a_local_save_restores_a_committed_step_bitwise(tmp_path, trials):
    n = max(1, trials * 2 // 3)
    summary = _harness(str(tmp_path / "ckpt"), None, n, seed=1, timeout=220)
    _check(summary, n)
    # Temporary files of killed pointer updates are removed by the next save's first pass.
    stray = [f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".tmp")]
    assert len(stray) <= 1, stray


@pytest.mark.timeout(240)
def test_killed_anywhere_in_an_s3_save_restores_a_committed_step_bitwise(bucket, trials):
    uri, options = bucket
    n = max(1, trials - trials * 2 // 3)
    _check(_harness(uri, options, n, seed=2, timeout=220), n)


@pytest.mark.timeout(240)
def test_killed_anywhere_in_a_save_to_ceph_rgw_restores_a_committed_step_bitwise(
    rgw_bucket, trials
):
    """The same trials on a second S3 server, Ceph's (conditional commit, multipart and
    listing as a production object store does them), beside moto's (not counted in
    ``--trials``: a tenth as many)."""
    uri, options = rgw_bucket
    n = max(1, trials // 10)
    _check(_harness(uri, options, n, seed=3, timeout=220), n)


# -- crash points themselves ------------------------------------------------------------


def _fork(fn: Any) -> int:
    """Run ``fn`` in a forked child; its exit status (negative: the signal)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@pytest.mark.timeout(30)
def test_a_crash_point_kills_on_its_nth_hit_for_its_rank_only():
    def hits(spec: str, rank: int, n: int) -> None:
        faults.arm(spec, rank=rank)
        for _ in range(n):
            faults.point("manifest-commit")
            faults.point("stage")

    spec = "crash point=manifest-commit rank=1 hit=3"
    assert _fork(lambda: hits(spec, 1, 2)) == 0
    assert _fork(lambda: hits(spec, 1, 3)) == -signal.SIGKILL
    assert _fork(lambda: hits(spec, 0, 5)) == 0  # another rank's fault
    with pytest.raises(ValueError, match="point= one of"):
        faults.parse("crash point=nowhere")
    with pytest.raises(ValueError, match="hit= counts from 1"):
        faults.parse("crash point=stage hit=0")
    assert str(faults.parse("crash point=fsync")[0]) == "crash point=fsync hit=1"


# -- several ranks: snapshots and replicas ------------------------------------------------

MULTI_POINTS = ["snapshot-copy", "snapshot-seal", "replica-transfer", "replica-published"]


def _value(rank: int, step: int) -> torch.Tensor:
    return torch.arange(4096, dtype=torch.float32) * (rank + 1) + step


def _snapshot_until_killed(rank: int, world: int, root: str, spec: str, victim: int) -> None:
    """Snapshot (replicated to the other simulated node) until the crash point kills
    ``victim``; the survivor then dies too, as a restart-all launcher would kill it."""
    os.environ["UNBROKEN_NODE"] = str(rank)
    with open(os.path.join(root, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    ckpt = Checkpointer(
        os.path.join(root, "ckpt"), memory=True, replicas=1,
        memory_dir=os.path.join(root, f"node-{rank}"), job="j", timeout=60,
    )  # fmt: skip
    if rank != victim:
        threading.Thread(target=_die_with, args=(root, victim), daemon=True).start()
    faults.arm(spec, rank=rank)
    log = os.path.join(root, f"log-{rank}")
    try:
        for step in range(1, 9):
            with open(log, "a") as f:
                f.write(f"begin {step}\n")
            ckpt.snapshot(step, {"w": _value(rank, step), "meta": {"step": step}})
            ckpt.wait()  # complete on every rank, replicas included
            with open(log, "a") as f:
                f.write(f"done {step}\n")
    except Exception:
        if rank == victim:
            raise
        time.sleep(60)  # the survivor saw its peer go first: it waits to be killed
    os.kill(os.getpid(), signal.SIGKILL)  # not reached: the point never fired


def _die_with(root: str, victim: int) -> None:
    while not os.path.exists(os.path.join(root, f"pid-{victim}")):
        time.sleep(0.01)
    with open(os.path.join(root, f"pid-{victim}")) as f:
        pid = int(f.read())
    while os.path.exists(f"/proc/{pid}") and "Z" not in _proc_state(pid):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def _killed_ranks(fn: Any, *args: Any, world: int = 2, timeout: float = 90) -> list[int | None]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks that are all expected to be
    killed (`run_ranks` returns at once when every rank is expected to exit); their exit
    codes, once every rank has ended or ``timeout`` has passed (then killed: None)."""
    procs, _ = start_ranks(fn, args, world)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


def _log(path: str) -> list[tuple[str, int]]:
    with open(path) as f:
        return [(kind, int(step)) for kind, step in (line.split() for line in f)]


def _restore(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["UNBROKEN_NODE"] = str(rank)
    ckpt = Checkpointer(
        os.path.join(root, "ckpt"), memory=True, replicas=1,
        memory_dir=os.path.join(root, f"node-{rank}"), job="j", timeout=60,
    )  # fmt: skip
    state: dict[str, Any] = {"w": torch.zeros(4096), "meta": {"step": -1}}
    step = ckpt.restore(state)
    ckpt.close()
    same = step is not None and torch.equal(state["w"], _value(rank, step))
    return {"step": step, "bitwise": same and state["meta"] == {"step": step}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", MULTI_POINTS)
def test_a_rank_killed_while_snapshotting_or_replicating_restores_a_complete_step(tmp_path, point):
    victim, hit = MULTI_POINTS.index(point) % 2, 2 + MULTI_POINTS.index(point) % 3
    root = str(tmp_path)
    spec = f"crash point={point} rank={victim} hit={hit}"
    codes = _killed_ranks(_snapshot_until_killed, root, spec, victim)
    assert codes == [-signal.SIGKILL] * 2, f"{spec}: exit codes {codes}"
    logs = [_log(os.path.join(root, f"log-{r}")) for r in (0, 1)]
    done = [step for log in logs for kind, step in log if kind == "done"]
    begun = [step for kind, step in logs[victim] if kind == "begin"]
    floor, newest = max(done, default=None), max(begun)
    assert newest < 8, f"{spec} never fired"
    results = run_ranks(_restore, root, timeout=90)
    print(f"{spec}: finished {floor}, begun {newest}, restored {results}")
    steps = {r["step"] for r in results}
    assert len(steps) == 1, f"ranks restored different steps: {results}"
    step = steps.pop()
    assert step in {floor, newest} and all(r["bitwise"] for r in results), results
