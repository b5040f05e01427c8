"""A checkpoint folder may be hostile: nothing read from it steers a write or a delete
outside what the job created. No symbolic link (nor hard link) is written through, none
is deleted through, no file that is a link is read; ``unbroken gc`` keeps a restorable
step as ``keep=`` does (issue 31, "Checkpoint folders")."""

import os
import stat
from pathlib import Path

import pytest
import torch

from unbroken import Checkpointer, CheckpointError, CorruptCheckpointError
from unbroken.cli.main import main
from unbroken.format.layout import MANIFEST, step_dir
from unbroken.storage.local import LocalStorage

PRECIOUS = b"a file outside the checkpoint, readable by its owner only\n"


def _save(root: str | os.PathLike[str], *steps: int, keep: int | None = None) -> None:
    ckpt = Checkpointer(root, keep=keep)
    for step in steps:
        ckpt.save(step, {"w": torch.full((8,), float(step))})
    ckpt.close()


def _shards(root: str | os.PathLike[str], step: int) -> list[str]:
    folder = os.path.join(root, step_dir(step))
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def _outside(tmp_path: Path, name: str = "secret") -> str:
    """A 0644 file outside any checkpoint, as a link planted in one would name it."""
    path = tmp_path / "outside" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(PRECIOUS)
    path.chmod(0o644)
    return str(path)


def _unchanged(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read() == PRECIOUS
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


# -- gc keeps what keep= keeps -----------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_gc_keeps_the_newest_whole_step_when_the_newest_is_damaged(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 1, 2, 3)
    shard = _shards(tmp_path, 3)[0]
    if damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) // 2)
    else:
        os.unlink(shard)
    assert main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert Checkpointer(tmp_path).steps() == [2, 3]  # 3 kept for inspection, 2 to restore
    assert "step 3 is damaged" in caplog.text
    state = {"w": torch.zeros(8)}
    assert Checkpointer(tmp_path).restore(state) == 2
    assert torch.equal(state["w"], torch.full((8,), 2.0))


# -- deleting never goes through a link --------------------------------------------------


@pytest.mark.parametrize("by", ["keep", "gc"])
def test_retention_deletes_a_linked_step_folder_as_a_link(tmp_path: Path, by: str) -> None:
    """A fine-tune run that links a pre-training step: letting it go removes the link;
    the pre-training checkpoint stays committed and whole."""
    pre, tune = tmp_path / "pretrain", tmp_path / "finetune"
    _save(pre, 100)
    tune.mkdir()
    os.symlink(pre / step_dir(100), tune / step_dir(100))
    state = {"w": torch.zeros(8)}
    assert Checkpointer(tune).restore(state) == 100  # reading through a linked folder works
    _save(tune, 101, 102, keep=1 if by == "keep" else None)
    if by == "gc":
        assert main(["gc", str(tune), "--keep-last", "1"]) == 0
    assert os.path.isfile(pre / step_dir(100) / MANIFEST)
    assert Checkpointer(tune).steps() == [102]
    assert not os.path.lexists(tune / step_dir(100))  # the link went
    assert Checkpointer(pre).steps() == [100]
    assert Checkpointer(pre).restore(state) == 100


def test_deleting_a_link_removes_the_link_and_nothing_through_it(tmp_path: Path) -> None:
    secret = _outside(tmp_path)
    folder = os.path.dirname(secret)
    storage = LocalStorage(str(tmp_path / "root"))
    storage.write("real/f", [b"x"])
    os.symlink(folder, tmp_path / "root" / "linked")
    os.symlink(secret, tmp_path / "root" / "real" / "file-link")
    storage.delete("linked/secret")  # through a linked folder: not this storage's
    storage.delete("real")  # rmtree removes the link inside, not its target
    storage.delete("linked")
    _unchanged(secret)
    assert os.listdir(folder) == ["secret"]
    assert storage.list("") == []


# -- saves never write through a link ----------------------------------------------------


def test_a_save_refuses_a_linked_future_step_folder(tmp_path: Path) -> None:
    secret = _outside(tmp_path, "r00000-000.safetensors")  # the name a shard would take
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root)
    ckpt.save(1, {"w": torch.zeros(8)})
    ckpt.wait()
    os.symlink(os.path.dirname(secret), root / step_dir(2))  # after the job's one listing
    with pytest.raises(CheckpointError, match=f"{step_dir(2)} is a symbolic link.*remove the"):
        ckpt.save(2, {"w": torch.full((8,), 2.0)})
        ckpt.wait()
    ckpt.close()
    _unchanged(secret)
    assert os.listdir(os.path.dirname(secret)) == ["r00000-000.safetensors"]


def test_a_save_refuses_a_linked_shard_name(tmp_path: Path) -> None:
    secret = _outside(tmp_path)
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root)
    ckpt.save(1, {"w": torch.zeros(8)})
    ckpt.wait()
    (root / step_dir(2)).mkdir()
    os.symlink(secret, root / step_dir(2) / os.path.basename(_shards(root, 1)[0]))
    with pytest.raises(CheckpointError, match=r"\.safetensors is a symbolic link.*remove the link"):
        ckpt.save(2, {"w": torch.full((8,), 2.0)})
        ckpt.wait()
    ckpt.close()
    _unchanged(secret)
    assert Checkpointer(root).steps() == [1]


def test_a_link_left_where_a_step_folder_goes_is_removed_not_written_through(
    tmp_path: Path,
) -> None:
    secret = _outside(tmp_path, "r00000-000.safetensors")
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(os.path.dirname(secret), root / step_dir(5))  # no manifest: a leftover
    _save(root, 5)
    _unchanged(secret)
    assert os.listdir(os.path.dirname(secret)) == ["r00000-000.safetensors"]
    assert not os.path.islink(root / step_dir(5))
    assert Checkpointer(root).steps() == [5]


@pytest.mark.parametrize(
    ("how", "says"), [("symlink", "is a symbolic link"), ("link", "is not a file of this")]
)
def test_the_local_storage_writes_no_file_that_is_a_link(
    tmp_path: Path, how: str, says: str
) -> None:
    secret = _outside(tmp_path)
    root = tmp_path / "root"
    storage = LocalStorage(str(root))
    storage.write("d/keep", [b"x"])
    getattr(os, how)(secret, root / "d" / "f")
    with pytest.raises(CheckpointError, match=f"{root}/d/f {says}.*save to another folder"):
        storage.write("d/f", [b"overwritten"])
    with pytest.raises(FileExistsError):
        storage.commit("d/f", b"no")
    storage.replace("d/f", b"replaced")  # the name is replaced, not what it named
    assert storage.read("d/f") == b"replaced"
    os.symlink(os.path.dirname(secret), root / "linked")
    with pytest.raises(CheckpointError, match=f"{root}/linked is a symbolic link"):
        storage.write("linked/new", [b"x"])
    _unchanged(secret)
    assert os.listdir(os.path.dirname(secret)) == ["secret"]


# -- reads never show a link's target ----------------------------------------------------


def test_verify_refuses_a_linked_shard_without_showing_its_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 1)
    shard = _shards(tmp_path, 1)[0]
    secret = tmp_path / "outside-secret"
    head = b"$6$salt$"  # the first bytes of a password hash, as in the issue
    secret.write_bytes(head + b"h" * (os.path.getsize(shard) - len(head)))  # the shard's size
    os.unlink(shard)
    os.symlink(secret, shard)
    assert main(["verify", str(tmp_path)]) == 1  # damage found
    out = capsys.readouterr()
    text = out.out + out.err
    assert str(int.from_bytes(head, "little")) not in text
    assert f"{shard} is a symbolic link" in text.replace("\n", "")


def test_reads_refuse_a_file_that_is_a_link(tmp_path: Path) -> None:
    secret = _outside(tmp_path)
    storage = LocalStorage(str(tmp_path / "root"))
    storage.write("d/real", [b"x"])
    os.symlink(secret, tmp_path / "root" / "d" / "f")
    for read in (
        lambda: storage.read("d/f"),
        lambda: storage.size("d/f"),
        lambda: storage.read_into("d/f", 0, memoryview(bytearray(4))),
        lambda: storage.read_range("d/f", 0, 4),
    ):
        with pytest.raises(CorruptCheckpointError, match="d/f is a symbolic link"):
            read()


def test_a_linked_manifest_is_damage_named_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 1, 2)
    manifest = tmp_path / step_dir(2) / MANIFEST
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(manifest.read_bytes())
    manifest.unlink()
    os.symlink(copy, manifest)
    assert Checkpointer(tmp_path).steps() == [1, 2]  # listed, so that no save deletes it
    with pytest.raises(CorruptCheckpointError, match=f"{manifest} is a symbolic link"):
        Checkpointer(tmp_path).restore({"w": torch.zeros(8)}, fallback=False)
    assert main(["verify", str(tmp_path)]) == 1
    assert f"{manifest} is a symbolic link" in capsys.readouterr().err.replace("\n", "")
