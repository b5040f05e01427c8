"""What the commands write for the user (exports, conversions, token files, timelines,
reports) is as private as the checkpoints: files 0600 and folders 0700 whatever the
umask, or 0660 / 0770 with group access (`unbroken.access`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unbroken
import unbroken.dcp
from unbroken.access import GROUP_ENV, Access
from unbroken.cli.main import main as cli
from unbroken.goodput.cli import main as goodput
from unbroken.goodput.simulate_cli import main as simulate

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=[False, True], ids=["private", "group"])
def access(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Access]:
    """The modes expected, under umask 0 (as in many containers) for the whole test."""
    if request.param:
        monkeypatch.setenv(GROUP_ENV, "1")
    else:
        monkeypatch.delenv(GROUP_ENV, raising=False)
    old = os.umask(0)
    try:
        yield Access(group=request.param)
    finally:
        os.umask(old)


def _modes(*paths: Path) -> dict[str, str]:
    """The mode of each of ``paths`` and of everything under those that are folders."""
    found = {}
    for path in paths:
        found[str(path)] = oct(path.stat().st_mode & 0o7777)
        if path.is_dir():
            for sub in sorted(path.rglob("*")):
                found[str(sub)] = oct(sub.stat().st_mode & 0o7777)
    return found


def _assert_modes(access: Access, *paths: Path) -> None:
    modes = _modes(*paths)
    want = {p: oct(access.dir_mode if os.path.isdir(p) else access.file_mode) for p in modes}
    assert modes == want


def _checkpoint(path: Path) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with unbroken.Checkpointer(path) as ckpt:
        ckpt.save(3, {"model": model, "progress": unbroken.Progress(step=3)})
    return str(path)


def test_exports_follow_the_job_modes_not_the_umask(tmp_path: Path, access: Access) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "not-a-known-one"}))
    one, hf = tmp_path / "m.safetensors", tmp_path / "hf"
    assert cli(["export", ckpt, str(one), "-q"]) == 0
    assert cli(["export", ckpt, str(hf), "--format", "hf", "--config", str(config), "-q"]) == 0
    assert {p.name for p in hf.iterdir()} == {
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "config.json",
    }
    _assert_modes(access, one, hf)
    # Written again over files of another mode: the modes are set, not inherited.
    one.chmod(0o644)
    assert cli(["export", ckpt, str(one), "--force", "-q"]) == 0
    _assert_modes(access, one)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_to_dcp_follows_the_job_modes(tmp_path: Path, access: Access) -> None:
    native, out = _checkpoint(tmp_path / "ckpt"), tmp_path / "from-native"
    assert cli(["convert", native, str(out), "--to", "dcp"]) == 0
    assert {p.name for p in out.iterdir()} == {".metadata", "__0_0.distcp"}  # no staging left
    through_dcp, again = str(tmp_path / "via-dcp"), tmp_path / "from-dcp"
    state = {"w": torch.arange(6.0), "b": torch.ones(2)}
    writer = unbroken.dcp.Writer(through_dcp, step=1)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert cli(["convert", through_dcp, str(again), "--to", "dcp"]) == 0
    _assert_modes(access, out, again)


def test_tokenise_output_follows_the_job_modes(tmp_path: Path, access: Access) -> None:
    (tmp_path / "a.txt").write_text("hello, tokens")
    out = tmp_path / "tokens.bin"
    assert cli(["tokenise", str(tmp_path / "a.txt"), "-o", str(out)]) == 0
    _assert_modes(access, out, Path(f"{out}.json"))


def test_goodput_and_simulate_reports_follow_the_job_modes(tmp_path: Path, access: Access) -> None:
    run = tmp_path / "run"
    run.mkdir()
    events = [
        {"event": "launch", "t": 0.0},
        {"event": "process_start", "t": 1.0, "process_start": 0.2, "rank": 0, "pid": 9},
        {"event": "init_done", "t": 1.0, "rank": 0, "pid": 9},
        {"event": "steps", "t": 3.0, "rank": 0, "pid": 9, "spans": [[1, 1.0, 3.0]]},
    ]
    (run / "events-0-9.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events[1:]))
    (run / "launcher.jsonl").write_text(json.dumps(events[0]) + "\n")
    page, png = tmp_path / "g.html", tmp_path / "g.png"
    assert goodput([str(run), "--html", str(page), "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    plot = tmp_path / "s.png"
    assert simulate(["--days=1", "--seeds=1", "--strategy=traditional", f"--plot={plot}"]) == 0
    _assert_modes(access, page, png, plot)


@pytest.mark.parametrize("group", [False, True], ids=["private", "group"])
def test_the_run_timeline_follows_the_job_modes(tmp_path: Path, group: bool) -> None:
    script, timeline = tmp_path / "noop.py", tmp_path / "timeline.json"
    script.write_text("")
    env = {**os.environ, GROUP_ENV: "1" if group else "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "unbroken", "run", f"--timeline-json={timeline}"]
    cmd += ["--standalone", "--nproc-per-node=1", str(script)]
    old = os.umask(0)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(timeline.read_text())["recoveries"] == []
    _assert_modes(Access(group=group), timeline)
