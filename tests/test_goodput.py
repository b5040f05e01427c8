"""Goodput accounting (`unbroken.goodput`): the arithmetic on synthetic event logs whose
answers are worked out by hand, the worker's buffered event log, the HTML report in a
real headless Chromium, and a real `unbroken run` whose log `unbroken goodput` reads."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from unbroken.goodput import account
from unbroken.goodput.cli import main as goodput_main
from unbroken.run import contract, reached, rundir, worker
from unbroken.run.timeline import Timeline

ROOT = Path(__file__).resolve().parent.parent


def proc(rank: int, pid: int, start: float, t: float, attempt: int = 0) -> list[dict]:
    """A process's first events: started at ``start``, process group ready at ``t``."""
    base = {"rank": rank, "pid": pid, "attempt": attempt}
    return [
        {"event": "process_start", "t": t, "process_start": start, **base},
        {"event": "init_done", "t": t, **base},
    ]


def ev(name: str, t: float, rank: int, pid: int, **fields) -> dict:
    return {"event": name, "t": t, "rank": rank, "pid": pid, "attempt": 0, **fields}


def steps(rank: int, pid: int, first: int, last: int, t: float) -> dict:
    """Steps ``first``..``last``, one second each from ``t``."""
    spans = [[s, t + i, t + i + 1] for i, s in enumerate(range(first, last + 1))]
    return ev("steps", spans[-1][2], rank, pid, spans=spans)


def write(tmp_path: Path, events: list[dict]) -> Path:
    """Events as a run directory: one file per process, and the launcher's."""
    for e in events:
        name = f"events-{e['rank']}-{e['pid']}.jsonl" if "pid" in e else "launcher.jsonl"
        with open(tmp_path / name, "a") as f:
            f.write(json.dumps(e) + "\n")
    return tmp_path


def approx(seconds: dict, **expected: float) -> None:
    got = {k: round(seconds[k], 6) for k in expected}
    assert got == expected
    others = {k: v for k, v in seconds.items() if k not in expected}
    assert all(abs(v) < 1e-9 for v in others.values()), others


def test_a_run_without_failure_is_productive_but_for_setup_saves_and_warm_up(tmp_path):
    r = 0
    events = [{"event": "launch", "t": 0.0}, *proc(r, 10, 0.2, 1.0)]
    events += [ev("restore_start", 1.0, r, 10), ev("restore_done", 1.5, r, 10, step=None)]
    events += [ev("data_ready", 2.0, r, 10, seconds=0.5), steps(r, 10, 1, 2, 2.0)]
    # A blocking save after step 2 (4.0-4.5), inside step 3's span: checkpoint stall.
    events += [ev("save_start", 4.0, r, 10, blocking=True), ev("save_end", 4.5, r, 10)]
    events += [ev("steps", 6.5, r, 10, spans=[[3, 4.0, 5.5], [4, 5.5, 6.5]])]
    events += [{"event": "done", "t": 7.0, "exit_code": 0}]
    a = account(rundir.read(write(tmp_path, events)))
    assert a.wall_s == 7.0 and a.failures == [] and a.steps_recomputed == 0
    approx(a.seconds, productive=4.0, init=1.0, restore=0.5, data=0.5, checkpoint=0.5, other=0.5)
    assert a.goodput == pytest.approx(4.0 / 7.0)


def test_overlapping_background_saves_are_not_badput(tmp_path):
    events = [{"event": "launch", "t": 0.0}, *proc(0, 10, 0.0, 1.0), steps(0, 10, 1, 6, 1.0)]
    # Two background persists overlapping each other and the steps: 3.0-5.0 in all.
    for t0, t1, step in ((3.0, 4.2, 2), (3.5, 5.0, 3)):
        events += [ev("persist_start", t0, 0, 10, step=step, background=True)]
        events += [ev("persist_end", t1, 0, 10, step=step)]
    # A blocking save's persist is inside the save: not a background persist.
    events += [ev("persist_start", 6.0, 0, 10, step=5, background=False)]
    events += [ev("persist_end", 6.1, 0, 10, step=5)]
    a = account(events)
    approx(a.seconds, productive=6.0, init=1.0)
    assert a.persist_s == pytest.approx(2.0)


def failure_during_a_save() -> list[dict]:
    """Two ranks; rank 1 is killed at 9.5 while rank 0 saves step 8 (9.0, no end): the
    save is lost, the restart restores step 4 and redoes 5..8."""
    events: list[dict] = [{"event": "launch", "t": 0.0}]
    for r in (0, 1):
        events += [*proc(r, 100 + r, 0.0, 1.0), steps(r, 100 + r, 1, 8, 1.0)]
        events += [ev("first_step", 2.0, r, 100 + r, step=1)]
    events += [ev("save_start", 9.0, 0, 100, step=8, blocking=True)]
    events += [ev("fault", 9.5, 1, 101, spec="kill rank=1 step=8", step=8)]
    events += [{"event": "worker_exit", "t": 10.5, "rank": 1, "pid": 101, "step": 8}]
    for r in (0, 1):
        events += [*proc(r, 200 + r, 11.0, 12.0, attempt=1)]
        events += [ev("restore_start", 12.0, r, 200 + r), ev("restore_done", 13.0, r, 200 + r)]
    return events


def test_a_failure_during_a_save(tmp_path):
    events = failure_during_a_save()
    for r in (0, 1):
        events += [steps(r, 200 + r, 5, 10, 13.0), ev("first_step", 14.0, r, 200 + r, step=5)]
    events += [{"event": "done", "t": 19.5, "exit_code": 0}]
    a = account(events)
    # Per rank: init 0-1 and 11-12, detection 9.5-10.5, restart 10.5-11, restore 12-13,
    # steps 1-4 and 5-10 productive, the first 5-8 recomputed, 19-19.5 the end. Rank 0
    # saved 9-9.5 (checkpoint), rank 1 lost 9-9.5 of work in flight (recompute).
    approx(
        a.seconds,
        productive=10.0,
        init=2.0,
        detection=1.0,
        restart=0.5,
        restore=1.0,
        recompute=4.25,
        checkpoint=0.25,
        other=0.5,
    )
    assert a.steps_recomputed == 4
    assert a.failures == [
        {"what": "fault: kill rank=1 step=8", "t": 9.5, "step": 8, "detected_t": 10.5}
    ]


def test_a_process_that_stops_without_a_launcher_record_is_a_failure():
    """Plain torchrun keeps no log (the demo's launches): a rank's next process starting
    with no failure on record means the previous one stopped."""
    events = []
    for r in (0, 1):
        events += [*proc(r, 100 + r, 0.0, 1.0), steps(r, 100 + r, 1, 4, 1.0)]
        events += [*proc(r, 200 + r, 7.0, 8.0), steps(r, 200 + r, 3, 6, 8.0)]
    a = account(events)
    assert [(f["what"], f["t"], f["step"], f["detected_t"]) for f in a.failures] == [
        ("real failure: rank 0's process stopped (no launcher record)", 5.0, 4, None)
    ]
    # Per rank: init 0-1 and 7-8, steps 1-2 and 3-6 productive, the first 3-4 redone,
    # and from the last sign of life (5.0) to the next process: restart.
    approx(a.seconds, productive=6.0, recompute=2.0, init=2.0, restart=2.0)


def test_a_real_failure_during_recovery(tmp_path):
    """Rank 1's new process dies in its restore (a real failure: no fault injected);
    a second restart follows."""
    events = [e for e in failure_during_a_save() if not (e.get("pid") == 201 and e["t"] > 12.0)]
    events = [e for e in events if not (e.get("pid") == 200 and e["event"] == "restore_done")]
    events += [ev("restore_done", 12.6, 0, 200)]
    events += [{"event": "worker_exit", "t": 12.8, "rank": 1, "pid": 201}]
    for r in (0, 1):
        events += [*proc(r, 300 + r, 13.5, 14.0, attempt=2)]
        events += [ev("restore_start", 14.0, r, 300 + r), ev("restore_done", 14.5, r, 300 + r)]
        events += [steps(r, 300 + r, 5, 10, 14.5), ev("first_step", 15.5, r, 300 + r, step=5)]
    events += [{"event": "done", "t": 21.0, "exit_code": 0}]
    a = account(events)
    # Rank 1: the second failure is dated to its process's last sign of life (12.0), so
    # detection 12.0-12.8, restart 12.8-13.5, init 13.5-14, restore 14-14.5. Rank 0 was
    # restoring until 12.6: restore 0.6 + 0.5 and detection 1 + 0.2.
    approx(
        a.seconds,
        productive=10.0,
        init=2.5,
        detection=1.5,
        restart=1.2,
        restore=0.8,
        recompute=4.25,
        checkpoint=0.25,
        other=0.5,
    )
    assert [f["what"] for f in a.failures] == [
        "fault: kill rank=1 step=8",
        "real failure: rank 1 exited",
    ]
    tl = Timeline(t0=0.0, events=[dict(e) for e in events])
    summary = tl.summary()
    assert "no failure" not in summary and "real failure: rank 1 exited" in summary
    assert len(tl.recoveries()) == 2 and tl.recoveries()[1]["first_step_t"] == 15.5


def test_a_fault_at_step_1_is_one_failure_though_a_rank_logs_its_first_step_after_it():
    """A kill at step 1: a peer's first step of the run is logged just after the fault.
    It is of the attempt the fault struck in, so it does not end that failure, and the
    killed rank's exit is the same failure, not a second, real one."""
    events = [*proc(0, 100, 0.0, 1.0), *proc(1, 101, 0.0, 1.0)]
    events += [ev("first_step", 2.0, 1, 101, step=1)]
    events += [ev("fault", 2.01, 1, 101, spec="kill rank=1 step=1", step=1)]
    events += [ev("first_step", 2.02, 0, 100, step=1)]
    events += [{"event": "worker_exit", "t": 2.1, "rank": 1, "pid": 101, "attempt": 0}]
    events += [{"event": "respawn", "t": 2.1, "rank": 1, "pid": 102, "generation": 1}]
    events += [ev("first_step", 4.0, r, 100 + 2 * r, attempt=1, step=2) for r in (0, 1)]
    tl = Timeline(t0=0.0, events=[dict(e) for e in events], mode="in-process")
    assert [r["fault"] for r in tl.recoveries()] == ["kill rank=1 step=1"]
    assert "real failure" not in tl.summary()


# -- the worker's event log ----------------------------------------------------------


def test_steps_and_saves_are_buffered_and_written_together(tmp_path, monkeypatch):
    monkeypatch.setenv(contract.EVENTS_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(contract.HEARTBEAT_DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "2")
    worker.reset()
    try:
        t0 = time.time()
        for step in range(1, 201):
            worker.tick(step)
            worker.tick(step)  # the Checkpointer ticks again: no second span
        worker.event("save_start", step=200, blocking=True)
        worker.event("save_end", step=200)
        written = list(tmp_path.glob("events-*"))
        if time.time() - t0 < worker.FLUSH_S * 0.9:  # else a flush was due: fine too
            assert written == [], "buffered events were written before a flush was due"
        # Only the last step reached is there at once, in its memory-mapped record.
        assert [(e["step"], e["rank"]) for e in reached.read(tmp_path)] == [(200, 2)]
        worker.event("restore_done", step=200)  # a rare event: written at once, in order
        (log,) = tmp_path.glob("events-*")
        lines = [json.loads(line) for line in log.read_text().splitlines()]
    finally:
        worker.reset()
    names = [e["event"] for e in lines]
    assert names[0] == "process_start" and names[-3:] == ["save_start", "save_end", "restore_done"]
    spans = [s for e in lines if e["event"] == "steps" for s in e["spans"]]
    assert [s[0] for s in spans] == list(range(1, 201))
    assert all(a <= b for _, a, b in spans) and all(e["rank"] == 2 for e in lines)
    assert len(lines) <= 6  # 200 steps and two saves: a handful of lines, not hundreds


# -- the report: printed, JSON, HTML in a real browser --------------------------------


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no chromium here (Debian: apt-get install chromium; .ci/run installs it)")
    return found


def test_the_html_report_renders_in_chromium_with_the_printed_numbers(tmp_path, capsys):
    events = failure_during_a_save()
    for r in (0, 1):
        events += [steps(r, 200 + r, 5, 10, 13.0), ev("first_step", 14.0, r, 200 + r, step=5)]
    run_dir = write(tmp_path, [*events, {"event": "done", "t": 19.5, "exit_code": 0}])
    assert goodput_main([str(run_dir), "--no-files"]) == 0
    printed = capsys.readouterr().out
    assert goodput_main([str(run_dir), "--json", "--png", str(tmp_path / "t.png")]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["goodput"] == pytest.approx(10 / 19.5, abs=1e-6)
    assert figures["badput_s"]["checkpoint"] == 0.25 and figures["steps_recomputed"] == 4
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--dump-dom",
            (tmp_path / "goodput.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    # The table is built by the page's script: rows are only there if it ran.
    cell = r"</td><td>([^<]+)"
    rows = re.findall(rf'<tr id="row-(\w+)"[^>]*>.*?</span>([^<]+){cell}{cell}<', dom)
    assert len(rows) == 10, dom[:2000]
    for _, what, seconds, share in rows:
        assert re.search(
            rf"^  {re.escape(what)} +{re.escape(seconds)} +{re.escape(share)}$", printed, re.M
        ), (what, seconds, share, printed)
    goodput = re.search(r'<span id="goodput">([^<]+)</span>', dom)
    assert goodput is not None and f"goodput of {run_dir}: {goodput[1]} " in printed
    assert dom.count("<rect") >= 2 * 8  # the timeline: a bar per segment, both ranks


# -- a real launch ---------------------------------------------------------------------

JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    import unbroken
    from unbroken.run import event, init_process_group, tick

    init_process_group()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    ckpt = unbroken.Checkpointer(sys.argv[1])
    state = {"w": torch.zeros(4), "progress": unbroken.Progress(step=0)}
    ckpt.restore(state)
    time.sleep(0.2)  # the data pipeline's warm-up, say
    event("data_ready", seconds=0.2)
    for step in range(state["progress"].step + 1, 9):
        time.sleep(0.05)
        ones = torch.ones(4)
        dist.all_reduce(ones)
        state["w"] += ones
        state["progress"].step = step
        tick(step)
        if step % 3 == 0:
            ckpt.save(step, state)
        if step == 5 and attempt == 0 and dist.get_rank() == 1:
            os._exit(3)  # a real crash: nothing injected
    ckpt.close()
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(240)
def test_a_real_run_with_a_real_crash_is_accounted_for(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "unbroken",
        "run",
        "--nproc-per-node=2",
        "--max-restarts=1",
        str(tmp_path / "job.py"),
        str(tmp_path / "ckpt"),
    ]
    env = {**dict(__import__("os").environ), contract.RUN_DIR_ENV: str(run_dir)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    # torchrun stops rank 0 as soon as rank 1 dies: when the launcher sees both gone in one
    # poll, either may be named; exactly one real failure must be on the timeline.
    [failure] = re.findall(r"real failure: rank [01] exited", done.stderr)
    assert "no failure" not in done.stderr
    assert f"unbroken goodput {run_dir}" in done.stderr
    names = sorted(p.name for p in run_dir.iterdir())
    assert "launcher.jsonl" in names and not [n for n in names if n.startswith("rank-")]
    report = [sys.executable, "-m", "unbroken", "goodput", str(run_dir), "--json", "--no-files"]
    out = subprocess.run(report, capture_output=True, text=True, timeout=60, check=True)
    figures = json.loads(out.stdout)
    assert [f["what"] for f in figures["failures"]] == [failure]  # the rank named above
    assert figures["ranks"] == [0, 1] and 0 < figures["goodput"] < 1
    for cause in ("restart", "init", "restore", "checkpoint", "data"):
        assert figures["badput_s"][cause] > 0, cause
    total = figures["productive_s"] + sum(figures["badput_s"].values())
    assert total == pytest.approx(figures["wall_s"], abs=0.01)


class Hooks:
    def __init__(self) -> None:
        self.hung: list[int] = []

    def since(self, beat: float, attempt: int) -> float:
        return beat

    def on_hang(self, stale, now: float) -> None:
        self.hung += [s.rank for s in stale]

    def kill_node(self, node: int) -> None:
        raise AssertionError("no node to kill")

    def live_pids(self) -> list[int]:
        return []


@pytest.mark.parametrize("closed_ago, hung", [(1.0, False), (6.0, True), (None, True)])
def test_the_watchdog_lets_a_closing_process_shut_down_for_a_while(tmp_path, closed_ago, hung):
    """A process that closed its Checkpointer after its last beat is shutting down, not
    hung, for up to `CLOSE_GRACE` heartbeat timeouts (0.5 s here)."""
    from unbroken.run.pace import Pace
    from unbroken.run.watch import Watch

    now = time.time()
    beat = f"24 {now - closed_ago - 1 if closed_ago else now - 2:.6f} {os.getpid()} 0"
    (tmp_path / "rank-0").write_text(beat.ljust(contract.HEARTBEAT_BYTES - 1) + "\n")
    if closed_ago is not None:
        closing = {"event": "closing", "t": now - closed_ago, "rank": 0, "pid": os.getpid()}
        (tmp_path / f"events-0-{os.getpid()}.jsonl").write_text(json.dumps(closing) + "\n")
    hooks = Hooks()
    Watch(str(tmp_path), Timeline(), Pace(0.5), hooks).poll()
    assert hooks.hung == ([0] if hung else [])
