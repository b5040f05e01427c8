"""Goodput after a SIGKILL (issue 34): the step spans a killed process had buffered die
with it, but the step it last reached survives (`unbroken.run.reached`), and `unbroken
goodput` counts the steps between the restored one and that one as recomputed.

The arithmetic on synthetic logs (worked out by hand), the record a real SIGKILLed
process leaves, and two real jobs SIGKILLed at a known step that resume from an earlier
checkpoint: a job under plain launches with no launcher record (the demo's case), and
two ranks under `unbroken run`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unbroken.goodput import account, lost
from unbroken.run import contract, rundir


def ev(name: str, t: float, pid: int, **fields) -> dict:
    return {"event": name, "t": t, "rank": 0, "pid": pid, "attempt": 0, **fields}


def spans(first: int, last: int, t: float) -> list[list]:
    """Steps ``first``..``last``, one second each from ``t``."""
    return [[s, t + i, t + i + 1] for i, s in enumerate(range(first, last + 1))]


def killed_then_resumed(flushed: int | None, reached: int | None) -> list[dict]:
    """Process 10 restores step 2 at 1.0 and runs a step a second (step 3 ends at 2.0),
    has written its spans up to ``flushed`` when a SIGKILL takes it after ``reached``
    (None: before its first step); process 20 starts at 20.0, restores step 2 at 21.0,
    runs 3..12 and ends."""
    events = [ev("process_start", 0.0, 10, process_start=0.0)]
    events += [ev("restore_start", 0.5, 10), ev("restore_done", 1.0, 10, step=2)]
    if flushed is not None:
        events.append(ev("steps", flushed - 1.0, 10, spans=spans(3, flushed, 1.0)))
    if reached is not None:
        events.append(ev("reached", reached - 1.0, 10, step=reached))
    events += [ev("process_start", 20.5, 20, process_start=20.0)]
    events += [ev("restore_start", 20.5, 20), ev("restore_done", 21.0, 20, step=2)]
    events += [ev("steps", 31.0, 20, spans=spans(3, 12, 21.0))]
    return events


@pytest.mark.parametrize(
    "flushed, reached, recomputed",
    [
        (8, 8, 6),  # everything written: nothing to rebuild
        (5, 8, 6),  # 6..8 died in the buffer
        (None, 8, 6),  # nothing written since the restore: 3..8
        (None, None, 0),  # killed before its first step
    ],
)
def test_steps_since_the_restore_count_whatever_the_log_kept(flushed, reached, recomputed):
    a = account(killed_then_resumed(flushed, reached))
    assert a.steps_recomputed == recomputed
    # Process 10's steps each took a second; the second process's are all productive.
    assert a.seconds["recompute"] == pytest.approx(recomputed)
    assert a.seconds["productive"] == pytest.approx(10.0)
    assert sum(a.seconds.values()) == pytest.approx(a.wall_s)
    [failure] = a.failures  # plain launches: dated to the killed process's last step
    assert (failure["t"], failure["step"]) == ((reached or 2) - 1.0, reached)


def test_the_lost_steps_share_the_time_since_the_last_surviving_event():
    events = [ev("restore_done", 1.0, 10, step=30), ev("steps", 3.0, 10, spans=spans(31, 32, 1.0))]
    events += [ev("save_start", 3.5, 10, step=32)]  # written: a boundary
    events += [ev("persist_end", 4.0, 10, step=32)]  # in the background: none
    events += [ev("reached", 6.5, 10, step=35)]
    [rebuilt] = [e for e in lost.restore(events) if e.get("lost")]
    assert rebuilt["spans"] == [[33, 3.5, 4.5], [34, 4.5, 5.5], [35, 5.5, 6.5]]
    assert not [e for e in lost.restore(events) if e["event"] == "reached"]


# -- what a SIGKILL leaves ---------------------------------------------------------------

LOOP = textwrap.dedent(
    """
    import os, signal, sys
    from unbroken.run import event, tick
    event("restore_done", step=None)  # written at once; the spans that follow are not
    for step in range(1, int(sys.argv[1]) + 1):
        tick(step)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_sigkilled_process_leaves_the_step_it_reached(tmp_path):
    env = {**os.environ, contract.EVENTS_DIR_ENV: str(tmp_path), "RANK": "3"}
    env.pop(contract.HEARTBEAT_DIR_ENV, None)
    done = subprocess.run([sys.executable, "-c", LOOP, "500"], env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL
    events = rundir.read(tmp_path)
    [record] = [e for e in events if e["event"] == "reached"]
    assert (record["step"], record["rank"], record["attempt"]) == (500, 3, 0)
    assert record["pid"] == next(e["pid"] for e in events if e["event"] == "restore_done")


# -- real jobs, SIGKILLed at a known step --------------------------------------------------

# One rank of a job that saves every 4 steps; the ranks ``argv[2]`` names SIGKILL
# themselves right after step 11 of the first launch or attempt: the next restores step
# 8 and computes 9..11 again. Steps take 50 ms, well under the event log's once-a-second
# flush: the kill takes their spans with it.
JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch, torch.distributed as dist
    import unbroken
    from unbroken.run import init_process_group, tick

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        init_process_group()
    ckpt = unbroken.Checkpointer(sys.argv[1])
    state = {"w": torch.zeros(4), "progress": unbroken.Progress(step=0)}
    first = ckpt.restore(state) is None
    for step in range(state["progress"].step + 1, 15):
        time.sleep(0.05)
        ones = torch.ones(4)
        if distributed:
            dist.all_reduce(ones)
        state["w"] += ones
        state["progress"].step = step
        tick(step)
        if step % 4 == 0:
            ckpt.save(step, state)
        if step == 11 and first and os.environ.get("RANK", "0") in sys.argv[2].split(","):
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    if distributed:
        dist.destroy_process_group()
    """
)


def goodput(run_dir: Path) -> dict:
    """`unbroken goodput`'s figures for ``run_dir``, once it checked that the report
    counts the 3 steps lost, their time as recomputation on every rank, and every second
    of the wall clock under one cause."""
    report = [sys.executable, "-m", "unbroken", "goodput", str(run_dir), "--no-files"]
    text = subprocess.run(report, capture_output=True, text=True, timeout=60, check=True)
    assert "1 failure(s), 3 step(s) recomputed)" in text.stdout, text.stdout
    share = re.search(r"^  recomputation +[0-9.]+ +([0-9.]+) %$", text.stdout, re.M)
    assert share and float(share[1]) > 0, text.stdout
    out = subprocess.run([*report, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["steps_recomputed"] == 3, figures
    total = figures["productive_s"] + sum(figures["badput_s"].values())
    assert total == pytest.approx(figures["wall_s"], abs=0.01)
    # Each rank lost steps 9..11, of 50 ms at least each: the killed ones too.
    for rank, segments in account(rundir.read(run_dir)).segments.items():
        lost_s = sum(b - a for a, b, label in segments if label == "recompute")
        assert lost_s >= 0.1, (rank, segments)
    return figures


@pytest.mark.timeout(180)
def test_a_job_killed_with_no_launcher_record_counts_the_steps_it_lost(tmp_path):
    """The demo's case: plain launches, SIGKILLed with nothing to write a last word."""
    (tmp_path / "job.py").write_text(JOB)
    events = tmp_path / "events"
    env = {**os.environ, contract.EVENTS_DIR_ENV: str(events), "OMP_NUM_THREADS": "1"}
    job = [sys.executable, str(tmp_path / "job.py"), str(tmp_path / "ckpt"), "0"]
    codes = [subprocess.run(job, env=env, capture_output=True, timeout=120) for _ in "12"]
    assert [c.returncode for c in codes] == [-signal.SIGKILL, 0], codes[1].stderr[-3000:]
    [failure] = goodput(events)["failures"]
    assert failure["step"] == 11 and "no launcher record" in failure["what"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("killed", ["1", "0,1"])  # rank 0 then exits on its lost peer
def test_ranks_sigkilled_under_unbroken_run_count_the_steps_they_lost(tmp_path, killed):
    (tmp_path / "job.py").write_text(JOB)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "unbroken", "run", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += [str(tmp_path / "job.py"), str(tmp_path / "ckpt"), killed]
    env = {**os.environ, contract.RUN_DIR_ENV: str(run_dir), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    [failure] = goodput(run_dir)["failures"]
    assert failure["step"] == 11 and "real failure" in failure["what"], failure
