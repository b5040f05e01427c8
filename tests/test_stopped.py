"""A rank stopped while it starts (SIGSTOP before its first step: a machine that hangs as
the job starts, or bench/storm.py's hang landing on a restart) has no heartbeat to be
judged by until `contract.FIRST_STEP_S` has passed, and its peers wait for it in
rendezvous. The launcher reads its workers' process trees and judges a stopped one hung
once stopped past the heartbeat timeout, in both launch modes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from unbroken.run.procs import descendants, kill_tree, rank_of

TRAIN = Path(__file__).with_name("train_job.py")
TIMEOUT = 3.0


def stop_rank_1(launcher: subprocess.Popen[str], stopped: list[int]) -> None:
    """SIGSTOP rank 1's first process as soon as it exists: it is still importing."""
    while launcher.poll() is None and not stopped:
        for pid in descendants(launcher.pid):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"train_job.py" in cmdline and rank_of(pid) == 1:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                    break
        time.sleep(0.005)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["restart-all", "in-process"])
def test_a_rank_stopped_as_it_starts_is_found_hung_within_the_timeout(tmp_path, mode):
    out, timeline = tmp_path / "out", tmp_path / "timeline.json"
    out.mkdir()
    inproc = ["--in-process"] if mode == "in-process" else []
    cmd = [
        sys.executable, "-m", "unbroken.run", *inproc, f"--timeline-json={timeline}",
        "--standalone", "--nproc-per-node=2", f"--heartbeat-timeout={TIMEOUT:g}",
        "--max-restarts=2", "--monitor-interval=0.1", str(TRAIN), *inproc,
        f"--ckpt={tmp_path / 'ckpt'}", f"--out={out}", "--steps=12", "--save-every=5",
        "--setup-s=2",
    ]  # fmt: skip
    stopped: list[int] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:  # fmt: skip
        threading.Thread(target=stop_rank_1, args=(proc, stopped), daemon=True).start()
        try:
            _, stderr = proc.communicate(timeout=75)
        finally:
            kill_tree(proc.pid)
    assert proc.returncode == 0, stderr[-4000:]
    [pid] = stopped
    hangs = [e for e in json.loads(timeline.read_text())["events"]
             if e["event"] == "hang_detected"]  # fmt: skip
    assert hangs, f"the stopped rank was never judged: {stderr[-3000:]}"
    assert hangs[0].get("pid", pid) == pid and 1 in hangs[0].get("ranks", [hangs[0].get("rank")])
    # Judged past the timeout, at the next look at the process trees (every second).
    assert TIMEOUT <= hangs[0]["idle_s"] < TIMEOUT + 2.5, hangs[0]
    finals = [(out / f"final-{r}.bin").read_bytes() for r in range(2)]
    assert finals[0] == finals[1], "the job finished, its ranks agreeing"
