"""The first hour, as a new user spends it: every command the examples document and the
demo prints runs as printed and exits 0, and what goes wrong on the way is said in a line.

The commands are read out of the examples' docstrings and the demo's own output, so a
hint that goes stale fails here. Those that run one process are run as printed, in one
folder (their ``runs/...`` paths relative to it); those that start several (``unbroken
run``, ``torchrun``, Lightning's ``--devices 2``) take tens of seconds each, so here their
command lines are parsed as the launcher and the script parse them, and
tests/test_examples.py runs each example under the launcher. The demo's hints after a
whole demo are run by tests/test_demo.py, on its output."""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import runpy
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rich.console import Console

import unbroken
from unbroken.cli.main import main as cli
from unbroken.demo import run as demo
from unbroken.run import contract
from unbroken.run.pace import Pace
from unbroken.run.timeline import Timeline
from unbroken.run.watch import Watch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
S3_PORT = 9000  # the endpoint examples/object_storage.py documents


def documented(script: Path) -> list[list[str]]:
    """The commands of ``script``'s docstring (its indented lines, a trailing backslash
    joining the next), split as a shell splits them, comments dropped."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    commands, pending = [], ""
    for line in doc.splitlines():
        if not line.startswith("    "):
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        commands.append(shlex.split(pending, comments=True))
        pending = ""
    return commands


def demo_hints(output: str) -> list[list[str]]:
    """The commands the demo's output suggests: the indented lines after "Try:"."""
    hints = output.split("Try:", 1)[1].splitlines()[1:]
    return [shlex.split(line) for line in hints if line.startswith("  ")]


def _several_processes(argv: list[str]) -> bool:
    return argv[:2] == ["unbroken", "run"] or argv[0] == "torchrun" or "--devices" in argv


class _Parsed(Exception):
    """The script parsed its arguments: stop it there."""


def _script_parses(script: str, args: list[str]) -> None:
    """Run ``script``'s own argument parsing on ``args`` (and nothing after it)."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **kw):
        real(self, *a, **kw)
        raise _Parsed

    with pytest.MonkeyPatch.context() as patch, pytest.raises(_Parsed):
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", [script, *args])
        runpy.run_path(script, run_name="__main__")


def _check_launch(argv: list[str]) -> None:
    """A command that starts several processes, checked as its launcher and its script
    would parse it (the script must exist, every option must be known)."""
    if argv[:2] == ["unbroken", "run"]:
        from unbroken.run.args import parse

        script = parse(argv[2:]).script
    elif argv[0] == "torchrun":
        from unbroken.run.args import torchrun_parser

        targs = torchrun_parser().parse_args(argv[1:])
        script = [targs.training_script, *targs.training_script_args]
    else:
        assert argv[0] == "python", argv
        script = argv[1:]
    _script_parses(script[0], script[1:])


def _run(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run one documented command as printed, in the current folder; it must exit 0."""
    if argv[0] == "export":  # export NAME=... : placeholders, filled by the test's values
        return
    if _several_processes(argv):
        _check_launch(argv)
        return
    if argv[0] == "unbroken":
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert cli(argv[1:]) == 0, argv
        return
    assert argv[0] == "python", argv
    proc = subprocess.run(
        [sys.executable, *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout[-1000:]}{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture
def first_hour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder like a fresh clone's: ``examples/`` in it, the commands run from it."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def s3_on_the_documented_port() -> Iterator[dict[str, str]]:
    """A moto S3 server where examples/object_storage.py says one is, holding the bucket
    it names; the credentials its ``export`` line stands for."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", S3_PORT)) == 0:
            pytest.skip(f"port {S3_PORT} is taken: the example's endpoint cannot be served")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=S3_PORT, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    try:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{S3_PORT}",
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        ).create_bucket(Bucket="bucket")
        yield env
    finally:
        server.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_command_an_example_documents_runs_as_printed(
    script: Path, first_hour: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    commands = documented(script)
    assert commands, f"{script.name} documents no command to run it"
    env = {}
    if any(a.startswith("s3://") for argv in commands for a in argv):
        env = request.getfixturevalue("s3_on_the_documented_port")
    for argv in commands:
        _run(argv, env, monkeypatch)


def test_the_documented_commands_are_read_as_a_shell_reads_them() -> None:
    [launch] = documented(ROOT / "examples" / "ddp.py")
    assert launch[:2] == ["unbroken", "run"] and "kill rank=1 step=25" in launch
    assert launch[-2:] == ["--save-every", "10"]  # the continuation line joined
    assert ["unbroken", "verify", "runs/dcp", "--all"] in documented(ROOT / "examples" / "dcp.py")


@pytest.fixture
def failed_demo(tmp_path: Path) -> Path:
    """What a demo leaves when its second launch failed: the uninterrupted run's
    checkpoints, an empty ``killed/``, no event log of it."""
    root = tmp_path / "demo"
    net = torch.nn.Linear(4, 2)
    with unbroken.Checkpointer(root / "uninterrupted") as ckpt:
        ckpt.save(5, {"model": net})
    (root / "killed").mkdir()
    return root


def test_after_a_failed_demo_every_hint_points_at_what_is_there(
    failed_demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    demo._keep_or_clean(Console(file=out, width=80), failed_demo, created=True, clean=False)
    hints = demo_hints(out.getvalue())
    assert len(hints) >= 4, out.getvalue()
    assert not any(str(failed_demo / "killed") in h for hint in hints for h in hint)
    monkeypatch.chdir(failed_demo.parent)
    for argv in hints:
        assert argv[0] == "unbroken"
        assert cli(argv[1:]) == 0, argv


def test_a_failed_launch_shows_its_first_error_not_its_last_lines() -> None:
    log = [
        "starting",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "train.py", line 3, in <module>',
        "[rank1]: ValueError: the cause",
        *[f"[rank0]: consequence {i}" for i in range(100)],
    ]
    shown, skipped = demo.first_error(log)
    assert shown[0] == log[1] and "[rank1]: ValueError: the cause" in shown
    assert skipped == len(log) - 1 - len(shown) and skipped > 0
    assert demo.first_error(["a", "b"]) == (["a", "b"], 0)  # nothing like an error: the end


def test_the_demo_says_what_its_time_depends_on() -> None:
    assert "busy" in demo.EXPECTED_TIME
    readme = (ROOT / "README.md").read_text()
    try_it = " ".join(readme.split("## Try it", 1)[1].split("```", 1)[0].split())
    assert "longer on a busy machine" in try_it and "import torch" in try_it


def test_the_object_storage_example_says_a_bucket_is_missing_in_one_line(
    first_hour: Path, s3_on_the_documented_port: dict[str, str]
) -> None:
    script = ROOT / "examples" / "object_storage.py"
    assert "bucket must exist" in (ast.get_docstring(ast.parse(script.read_text())) or "")
    proc = subprocess.run(
        [sys.executable, str(script), "--url", "s3://no-such-bucket/x", "--steps", "1",
         "--endpoint", f"http://127.0.0.1:{S3_PORT}"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, **s3_on_the_documented_port},
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "no bucket 'no-such-bucket'" in line


def test_the_readme_lists_every_example_and_nothing_out_of_date() -> None:
    readme = (ROOT / "README.md").read_text()
    for script in EXAMPLES:
        assert f"| `examples/{script.name}` |" in readme, script.name
    assert "Not there yet" not in readme
    assert "unbroken-demo-*/" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_finished_rank_is_reported_at_its_last_step_not_its_last_heartbeat(
    tmp_path: Path,
) -> None:
    """Heartbeats are written at most every 0.2 s: a rank's last one can be steps behind
    where it finished. Its step spans, flushed as it exits, say where it ended."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    beat = f"10 {time.time() - 1:.6f} {gone.pid} 0"
    (tmp_path / "rank-0").write_text(beat.ljust(contract.HEARTBEAT_BYTES - 1) + "\n")
    spans = {"event": "steps", "t": time.time(), "rank": 0, "pid": gone.pid,
             "spans": [[19, 0.0, 1.0], [20, 1.0, 2.0]]}  # fmt: skip
    (tmp_path / contract.events_file(0, gone.pid)).write_text(json.dumps(spans) + "\n")
    timeline = Timeline()

    class Hooks:
        def since(self, beat: float, attempt: int) -> float:
            return beat

        def on_hang(self, stale: object, now: float) -> None:
            raise AssertionError("an exited rank is not hung")

        def kill_node(self, node: int) -> None:
            raise AssertionError("no node to kill")

        def live_pids(self) -> list[int]:
            return []

    Watch(str(tmp_path), timeline, Pace(60.0), Hooks()).poll()
    [exit_event] = [e for e in timeline.events if e["event"] == "worker_exit"]
    assert exit_event["step"] == 20
