"""Who may read what a job writes: checkpoint files, shared-memory snapshots and event logs
are the job's user's alone (0600 / 0700) whatever the umask, or its group's too when asked
(`unbroken.access`); another user on the node can neither read them nor plant a folder
the job would take for its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from unbroken import Checkpointer, CheckpointError, Progress
from unbroken.access import GROUP_ENV, Access
from unbroken.memory.paths import folder_name
from unbroken.memory.tier import MemoryTier
from unbroken.run.rundir import new_dir
from unbroken.run.timeline import Timeline

pytestmark = pytest.mark.timeout(120)


def _state() -> dict:
    model = torch.nn.Linear(8, 4)
    return {"model": model, "p": Progress(step=0)}


def _save_everything(base: Path) -> None:
    """A save, a snapshot and an event log, all under ``base``, with umask 0."""
    old = os.umask(0)
    try:
        ckpt = Checkpointer(base / "ckpt", memory=True, memory_dir=str(base / "shm"), job="j")
        state = _state()
        ckpt.save(1, state)
        ckpt.snapshot(2, state)
        ckpt.wait()
        ckpt.close()
        code = "from unbroken.run.worker import event; event('probe', ok=1)"
        env = {**os.environ, "UNBROKEN_EVENTS_DIR": str(base / "events" / "run")}
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
        run = new_dir()  # the launcher's run directory, under $XDG_STATE_HOME
        Timeline(log=str(run / "launcher.jsonl")).add("probe")
    finally:
        os.umask(old)


def _created(base: Path) -> Iterator[tuple[str, int]]:
    """``(path, mode)`` of everything the job created under ``base``, the shared-memory
    root included (this user's own, never a folder shared with other users)."""
    for top in ("ckpt", "shm", "events/run", "state"):
        for folder, _dirs, files in os.walk(base / top):
            yield folder, os.stat(folder).st_mode
            for name in files:
                path = os.path.join(folder, name)
                yield path, os.stat(path).st_mode


@pytest.mark.parametrize("group", [False, True])
def test_everything_created_is_private_whatever_the_umask(tmp_path, monkeypatch, group):
    if group:
        monkeypatch.setenv(GROUP_ENV, "1")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("UNBROKEN_RUN_DIR", raising=False)
    _save_everything(tmp_path)
    access = Access(group=group)
    seen = {"dir": 0, "file": 0}
    for path, mode in _created(tmp_path):
        kind = "dir" if os.path.isdir(path) else "file"
        want = access.dir_mode if kind == "dir" else access.file_mode
        assert mode & 0o7777 == want, f"{path}: {oct(mode & 0o7777)}, expected {oct(want)}"
        seen[kind] += 1
    names = {os.path.basename(p) for p, _ in _created(tmp_path)}
    assert {"slot-0.bin", "slot-0.json", "owner-00000", "manifest.json", "launcher.jsonl"} <= names
    assert any(n.startswith("events-") for n in names), names
    assert seen["dir"] >= 5 and seen["file"] >= 6, seen
    assert os.stat(tmp_path / "shm").st_mode & 0o7777 == access.dir_mode


def _as_nobody(paths: list[str]) -> dict[str, str]:
    """Try to open each path for reading and writing as user ``nobody``: what happened."""
    import pwd

    nobody = pwd.getpwnam("nobody")

    def drop() -> None:
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)

    # /bin/sh, not Python: the interpreter may live where `nobody` cannot go (/root).
    script = textwrap.dedent("""
        for path; do
            for mode in rb r+b; do
                if [ "$mode" = rb ]; then err=$( (exec 3<"$path") 2>&1 )
                else err=$( (exec 3<>"$path") 2>&1 ); fi
                case "$err" in
                    "") echo "$path $mode opened" ;;
                    *"ermission denied"*) echo "$path $mode PermissionError" ;;
                    *) echo "$path $mode $err" | tr -s ' \n' '__' ; echo ;;
                esac
            done
        done
    """)
    out = subprocess.run(
        ["/bin/sh", "-c", script, "sh", *paths],
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    results: dict[str, str] = {}
    for line in out.stdout.splitlines():
        path, mode, what = line.rsplit(" ", 2)
        results[f"{path} {mode}"] = what
    return results


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A folder every user may enter (pytest's own temporary folder is the root user's
    alone, which would hide the modes under test)."""
    if os.geteuid() != 0:
        pytest.skip("playing another user needs root (to run a child as `nobody`)")
    base = Path(tempfile.mkdtemp(prefix="unbroken-access-"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_another_user_cannot_read_or_overwrite_snapshots_or_shards(open_base):
    _save_everything(open_base)
    control = open_base / "control"
    control.write_bytes(b"x")
    os.chmod(control, 0o666)
    slot = str(open_base / "shm" / folder_name("j") / "rank-00000" / "slot-0.bin")
    shard = next(p for p, _ in _created(open_base) if p.endswith(".safetensors"))
    targets = [slot, shard, str(control)]
    result = _as_nobody(targets)
    assert result[f"{control} rb"] == "opened"  # the child could read what is open to it
    for path in (slot, shard):
        assert result[f"{path} rb"] == "PermissionError", result
        assert result[f"{path} r+b"] == "PermissionError", result
    # The folders keep everyone out; the files do too on their own.
    for path, _ in list(_created(open_base)):
        if os.path.isdir(path):
            os.chmod(path, 0o755)
    result = _as_nobody(targets)
    assert result[f"{slot} rb"] == "PermissionError", result
    assert result[f"{shard} rb"] == "PermissionError", result
    assert result[f"{shard} r+b"] == "PermissionError", result


def test_a_job_folder_planted_by_another_user_is_refused(open_base):
    import pwd

    nobody = pwd.getpwnam("nobody")
    planted = open_base / "shm" / folder_name("j")
    planted.mkdir(parents=True)
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(CheckpointError, match=r"belongs to user id .* not this job's user"):
        MemoryTier(str(open_base / "shm"), "j", 0, 1)
    assert os.listdir(planted) == []  # nothing written into it


def test_group_access_from_the_environment(monkeypatch):
    monkeypatch.delenv(GROUP_ENV, raising=False)
    assert Access.from_env() == Access(group=False)
    monkeypatch.setenv(GROUP_ENV, "0")
    assert Access.from_env().file_mode == 0o600
    monkeypatch.setenv(GROUP_ENV, "1")
    assert (Access.from_env().file_mode, Access.from_env().dir_mode) == (0o660, 0o770)
