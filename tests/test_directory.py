"""The checkpoint directory: what counts as committed, the latest pointer, leftovers,
deletion (retention: tests/test_retention.py)."""

import json

import pytest
import torch

from unbroken import Checkpointer
from unbroken.errors import CheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import LATEST, MANIFEST, step_dir
from unbroken.storage import open_storage


@pytest.fixture
def directory(tmp_path) -> Directory:
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((4,), float(step))})
    return Directory(open_storage(str(tmp_path)), str(tmp_path))


def test_only_steps_with_a_manifest_count(directory, tmp_path):
    (tmp_path / step_dir(4)).mkdir()  # a save that crashed before its commit
    (tmp_path / step_dir(4) / "r00000-000.safetensors").write_bytes(b"partial")
    assert directory.steps() == [1, 2, 3]
    assert directory.leftovers() == [step_dir(4)]
    assert directory.is_committed(3) and not directory.is_committed(4)
    directory.clear_leftovers()
    assert directory.leftovers() == [] and not (tmp_path / step_dir(4)).exists()


def test_latest_follows_the_pointer_and_falls_back_to_listing(directory, tmp_path):
    assert json.loads((tmp_path / LATEST).read_text()) == {"step": 3}
    directory.move_latest(2)
    assert directory.latest() == 2  # the pointer, not a listing
    directory.delete(2)
    assert directory.latest() == 3  # it points at a step that is gone
    (tmp_path / LATEST).unlink()
    assert directory.latest() == 3


def test_pointed_is_the_pointer_unchecked_and_a_restore_survives_a_stale_one(directory, tmp_path):
    directory.delete(3)
    assert directory.pointed() == 3  # what the pointer says, gone or not
    assert directory.latest() == 2
    # A restore reads the pointed step's manifest without asking first whether it is
    # there; when it is gone, the listing says which step is the newest.
    state = {"w": torch.zeros(4)}
    assert Checkpointer(tmp_path).restore(state) == 2
    assert torch.equal(state["w"], torch.full((4,), 2.0))
    (tmp_path / LATEST).unlink()
    assert directory.pointed() == 2  # no pointer: by listing


def test_delete_removes_the_manifest_first_and_the_step_whole(directory, tmp_path):
    directory.delete(1)
    assert directory.steps() == [2, 3] and not (tmp_path / step_dir(1)).exists()
    assert directory.manifest().step == 3
    assert not (tmp_path / step_dir(1) / MANIFEST).exists()


def test_a_missing_step_names_the_committed_ones(directory):
    with pytest.raises(
        CheckpointError, match="no committed checkpoint for step 9; committed steps: 1, 2, 3"
    ):
        directory.manifest(9)
    with pytest.raises(CheckpointError, match="committed by another writer meanwhile"):
        directory.commit(directory.manifest(3))
