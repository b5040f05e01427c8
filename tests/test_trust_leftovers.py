"""Trust nothing twice, the leftovers: a suspect step restored from shared memory warns
as from storage; a linked or unreadable newest manifest is damage passed over; `unbroken
verify` gives a linked shard a DAMAGED verdict; a file named like a step folder is no
step and crashes nothing; a meta tensor is refused by name; the stress script finds the
two-rank test files itself."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from unbroken import Checkpointer, CheckpointError, CorruptCheckpointError
from unbroken.cli.main import main
from unbroken.format.layout import MANIFEST, step_dir
from unbroken.restoring.sources import Origin
from unbroken.sdc import SUSPECT, Divergence, record

pytestmark = pytest.mark.timeout(120)


def _save(root: Path, *steps: int) -> None:
    with Checkpointer(root) as ckpt:
        for step in steps:
            ckpt.save(step, {"w": torch.full((8,), float(step))})


def _told(caplog: pytest.LogCaptureFixture) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# -- 1. a suspect step restored from shared memory warns ----------------------------------


def test_a_suspect_step_restored_from_shared_memory_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def make() -> Checkpointer:
        return Checkpointer(tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "shm"))

    state = {"w": torch.arange(8.0)}
    ckpt = make()
    ckpt.save(2, state)  # as a save that found replicas differing marks it
    diverged = Divergence("w", (0,), {"aaaa": [0], "bbbb": [1]})
    ckpt.storage.write(f"{step_dir(2)}/{SUSPECT}", [record([diverged])])
    ckpt.snapshot(2, state)
    ckpt.close()
    back = {"w": torch.zeros(8)}
    restored = make()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        assert restored.restore(back) == 2
    last = restored.last_restore
    assert last is not None and last.origin.kind == "memory"
    assert torch.equal(back["w"], state["w"])
    told = _told(caplog)
    assert "step 2: data-parallel replicas differed when saved: w" in told, told
    assert "restore an earlier step" in told
    restored.close()


# -- 2. a linked or unreadable newest manifest is damage, passed over ---------------------


@pytest.mark.parametrize("how", ["symlink", "folder"])
def test_a_linked_or_unreadable_newest_manifest_falls_back_naming_it(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 1, 2)
    manifest = tmp_path / step_dir(2) / MANIFEST
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(manifest.read_bytes())
    manifest.unlink()
    if how == "symlink":
        os.symlink(copy, manifest)
    else:
        manifest.mkdir()  # a manifest no read can open as a file
    back = {"w": torch.zeros(8)}
    ckpt = Checkpointer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        assert ckpt.restore(back) == 1
    assert torch.equal(back["w"], torch.full((8,), 1.0))
    last = ckpt.last_restore
    assert last is not None and last.damaged == (Origin("storage", 2),)
    told = _told(caplog)
    assert f"step 2 is damaged: {manifest}" in told, told
    assert ("is a symbolic link" if how == "symlink" else "cannot be read") in told
    with pytest.raises(CorruptCheckpointError, match=f"{manifest}"):  # asked for: raised
        Checkpointer(tmp_path).restore(back, step=2)


# -- 3. verify: a linked shard is a DAMAGED verdict ---------------------------------------


def test_verify_gives_a_linked_shard_a_damaged_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 1, 2)
    folder = tmp_path / step_dir(2)
    [shard] = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    (tmp_path / "copy").write_bytes((folder / shard).read_bytes())
    os.unlink(folder / shard)
    os.symlink(tmp_path / "copy", folder / shard)
    assert main(["verify", "--all", str(tmp_path)]) == 1  # damage found
    out, err = capsys.readouterr()
    assert "error:" not in err, err
    assert f"DAMAGED step 2: {shard}: {folder / shard} is a symbolic link" in out, out
    assert "OK step 1" in out  # the other steps are still verified
    assert main(["verify", "--json", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    [damage] = report["steps"][0]["damage"]
    assert damage["file"] == shard and "is a symbolic link" in damage["problem"]


# -- 4. a file named like a step folder is no step -----------------------------------------


def test_a_file_named_like_a_step_folder_is_no_step_and_crashes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 1)
    stray = tmp_path / step_dir(12)
    stray.write_bytes(b"not a folder")
    assert Checkpointer(tmp_path).steps() == [1]
    back = {"w": torch.zeros(8)}
    assert Checkpointer(tmp_path).restore(back) == 1
    with pytest.raises(CheckpointError, match="no committed checkpoint for step 12"):
        Checkpointer(tmp_path).restore(back, step=12)
    for command in (["ls"], ["verify", "--all"], ["gc", "--keep-last", "1"]):
        assert main([*command, str(tmp_path)]) == 0, command
    assert "error" not in capsys.readouterr().err
    _save(tmp_path, 12)  # a leftover where a step folder goes: removed, as a link there is
    assert Checkpointer(tmp_path).steps() == [1, 12]
    assert Checkpointer(tmp_path).restore(back) == 12


# -- 5. a meta tensor is refused by name at capture ----------------------------------------


def test_a_meta_tensor_is_refused_by_name(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ckpt")
    state = {"model": torch.nn.Linear(2, 2, device="meta")}
    for attempt in (lambda: ckpt.save(1, state), lambda: ckpt.restore(state)):
        with pytest.raises(CheckpointError, match=r"^model/weight is a tensor on the meta") as e:
            attempt()
        assert "holds no data" in str(e.value) and "to_empty" in str(e.value)
    assert ckpt.steps() == []
    ckpt.close()


# -- 6. the stress script finds the two-rank test files ------------------------------------


def test_the_stress_script_finds_the_two_rank_test_files(tmp_path: Path) -> None:
    from test_stress import TESTS, two_rank_files  # here: the other tests run without it

    found = two_rank_files()
    assert {"test_distributed.py", "test_comm.py", "test_capture.py"} <= set(found)
    assert all((TESTS / name).is_file() for name in found)
    assert "test_trust_leftovers.py" not in found
    (tmp_path / "test_new.py").write_text('"""Two ranks."""\n\nTWO_RANK = True\n')
    (tmp_path / "test_other.py").write_text("X = 1  # TWO_RANK = True in a comment only\n")
    assert two_rank_files(tmp_path) == ["test_new.py"]
