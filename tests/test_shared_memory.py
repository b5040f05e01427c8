"""Shared memory no one else can steer: a job's folder is its own (the absolute path or
the explicit name, hashed into the folder name), the root is this user's, no symlink is
followed, every chunk of a snapshot is checked before use, and cleaning up never judges
a pid it cannot see."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unbroken import Checkpointer, CheckpointError, CorruptCheckpointError
from unbroken.format.layout import Manifest, checksum
from unbroken.memory.paths import clean_abandoned, folder_name, job_name
from unbroken.memory.tier import MemoryTier
from unbroken.run.contract import owner_text

pytestmark = pytest.mark.timeout(120)


def _snapshot(shm: Path, value: float, **kwargs) -> None:
    ckpt = Checkpointer(kwargs.pop("path", "ckpt"), memory=True, memory_dir=str(shm), **kwargs)
    ckpt.snapshot(3, {"w": torch.full((4,), value)})
    ckpt.wait()
    ckpt.close()


def _restored(shm: Path, **kwargs) -> float | None:
    state = {"w": torch.zeros(4)}
    ckpt = Checkpointer(kwargs.pop("path", "ckpt"), memory=True, memory_dir=str(shm), **kwargs)
    step = ckpt.restore(state)
    ckpt.close()
    return None if step is None else float(state["w"][0])


def test_two_jobs_saying_ckpt_in_different_folders_never_share_snapshots(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    _snapshot(tmp_path / "shm", 1.0)
    monkeypatch.chdir(tmp_path / "b")
    assert _restored(tmp_path / "shm") is None  # not the other project's state
    monkeypatch.chdir(tmp_path / "a")
    assert _restored(tmp_path / "shm") == 1.0  # its own, still there


@pytest.mark.parametrize("first,second", [("exp/1", "exp_1"), ("x/ck", "x_ck")])
def test_names_that_read_alike_keep_their_own_snapshots(tmp_path, first, second):
    assert folder_name(first) != folder_name(second)
    _snapshot(tmp_path / "shm", 1.0, job=first)
    _snapshot(tmp_path / "shm", 2.0, job=second)
    _snapshot(tmp_path / "shm", 2.0, job=second)  # a second and third slot: all of them
    assert _restored(tmp_path / "shm", job=first) == 1.0
    assert _restored(tmp_path / "shm", job=second) == 2.0


def test_torchruns_default_run_id_does_not_name_a_job(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    assert job_name("a/ckpt") != job_name("b/ckpt")
    assert job_name("a/ckpt") == os.path.abspath("a/ckpt")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    assert job_name("s3://bucket/ckpt") == "run-7:s3://bucket/ckpt"


def test_a_job_whose_owners_live_in_another_pid_namespace_is_never_removed(tmp_path):
    """Containers sharing /dev/shm (--ipc=host) see other containers' jobs but not their
    pids: such a job looks abandoned from here, and must be left alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    elsewhere = tmp_path / "shm" / "other-container-job"
    (elsewhere / "rank-00000").mkdir(parents=True)
    (elsewhere / "owner-00000").write_text(dead)  # a pid this namespace cannot judge
    abandoned = tmp_path / "shm" / "abandoned-job"
    (abandoned / "rank-00000").mkdir(parents=True)
    (abandoned / "owner-00000").write_text(owner_text(int(dead)))
    clean_abandoned(str(tmp_path / "shm"), "mine")
    assert sorted(os.listdir(tmp_path / "shm")) == ["other-container-job"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play another user")
def test_a_root_another_user_created_is_refused(tmp_path):
    nobody = pwd.getpwnam("nobody")
    root = tmp_path / "shm"
    root.mkdir(mode=0o1777)
    os.chmod(root, 0o1777)
    os.chown(root, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(CheckpointError, match=r"not this user's"):
        MemoryTier(str(root), "j", 0, 1)
    assert os.listdir(root) == []  # nothing written into it


def test_a_root_others_may_write_into_without_the_sticky_bit_is_refused(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(CheckpointError, match=r"not this user's"):
        MemoryTier(str(root), "j", 0, 1)


def test_a_symlinked_slot_file_is_never_written_through(tmp_path):
    victim = tmp_path / "private.txt"
    victim.write_text("secret")
    os.chmod(victim, 0o644)
    rank = tmp_path / "shm" / folder_name("j") / "rank-00000"
    rank.mkdir(parents=True)
    for slot in range(3):
        (rank / f"slot-{slot}.bin").symlink_to(victim)
    ckpt = Checkpointer(tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "shm"), job="j")
    with pytest.raises(CheckpointError, match="symlink"):
        ckpt.snapshot(1, {"w": torch.ones(1000)})
    assert victim.read_text() == "secret" and victim.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("where", ["rank-00000", "replicas"])
def test_a_symlinked_folder_is_never_written_into(tmp_path, where):
    victim = tmp_path / "victim"
    victim.mkdir()
    job = tmp_path / "shm" / folder_name("j")
    job.mkdir(parents=True)
    (job / where).symlink_to(victim)
    with pytest.raises(CheckpointError, match="symlink"):
        tier = MemoryTier(str(tmp_path / "shm"), "j", 0, 2)
        tier.replica(1)
    assert os.listdir(victim) == []


def test_every_chunk_of_a_snapshot_is_checked_before_use(tmp_path):
    """A description whose first chunk of a tensor is empty and whose second carries the
    bytes under a wrong checksum: the flipped byte never reaches the state."""
    _snapshot(tmp_path / "shm", 1.0, job="j")
    rank = tmp_path / "shm" / folder_name("j") / "rank-00000"
    [description] = rank.glob("slot-*.json")
    header = json.loads(description.read_text())
    manifest = json.loads(header["manifest"])
    [real] = manifest["tensors"]["w"]["chunks"]
    empty = {**real, "shape": [0], "end": real["start"], "xxh3": checksum(memoryview(b""))}
    manifest["tensors"]["w"]["chunks"] = [empty, {**real, "xxh3": "0" * 16}]
    header["manifest"] = json.dumps(manifest)
    description.write_text(json.dumps(header))
    data = rank / Path(description.name).with_suffix(".bin").name
    raw = bytearray(data.read_bytes())
    raw[real["start"]] ^= 0x40
    data.write_bytes(bytes(raw))
    tier = MemoryTier(str(tmp_path / "shm"), "j", 0, 1)
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        tier.own.verified(3)
    assert _restored(tmp_path / "shm", job="j") is None  # passed over, not restored


_JOB = """
import sys, torch, unbroken, unbroken.run
unbroken.run.init_process_group()
ckpt = unbroken.Checkpointer(sys.argv[1], memory=True)
ckpt.snapshot(1, {"w": torch.ones(10)})
ckpt.wait()
ckpt.close()
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("exit_code", [0, 1])
def test_a_job_that_ends_normally_frees_its_shared_memory_and_a_crash_keeps_it(tmp_path, exit_code):
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    shm = tmp_path / "shm"
    env = {**os.environ, "UNBROKEN_MEMORY_DIR": str(shm), "OMP_NUM_THREADS": "1"}
    env["UNBROKEN_RUN_DIR"] = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "unbroken.run", "--nproc-per-node=2", "--max-restarts=0",
           str(script), str(tmp_path / "ckpt"), str(exit_code)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == exit_code, done.stderr[-2000:]
    left = [p.name for p in shm.iterdir()]
    if exit_code == 0:
        assert left == [], left  # nothing left behind in /dev/shm
    else:
        assert len(left) == 1 and len(list((shm / left[0]).glob("rank-*/slot-*.bin"))) == 2


def test_a_leftover_folder_goes_once_no_rank_writes_it_and_a_written_one_is_not_parsed(
    tmp_path, monkeypatch
):
    """`MemoryTier.free_older`, after every snapshot: a folder some live rank wrote since
    the last call is kept without parsing its manifests (milliseconds each, at every
    snapshot of every rank on the node); once nobody writes it, its steps are read, and
    it goes when they are all older than the complete step."""
    shm = tmp_path / "shm"
    ckpt = Checkpointer(tmp_path / "ckpt", memory=True, memory_dir=str(shm), job="j")
    for step in (1, 2):
        ckpt.snapshot(step, {"w": torch.full((4,), float(step))})
    ckpt.wait()
    tier = MemoryTier(str(shm), "j", 0, 1)
    leftover = os.path.join(tier.root, "replicas", "rank-00000")
    shutil.copytree(tier.own.dir, leftover)  # as a replica this node no longer keeps
    parsed: list[str] = []
    real = Manifest.from_json

    def counted(*args, **kwargs):
        parsed.append(str(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(Manifest, "from_json", counted)
    assert tier.free_older(2) == [] and parsed  # first look: it holds step 2
    parsed.clear()
    slot = next(p for p in sorted(os.listdir(leftover)) if p.endswith(".json"))
    shutil.copy(os.path.join(leftover, slot), os.path.join(leftover, "new"))
    os.replace(os.path.join(leftover, "new"), os.path.join(leftover, slot))  # a writer
    assert tier.free_older(5) == [] and parsed == []  # written since: some rank's
    assert tier.free_older(5) == [leftover] and parsed  # unchanged: read, older, freed
    assert not os.path.exists(leftover) and os.path.isdir(tier.own.dir)
    ckpt.close()
