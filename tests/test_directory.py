"""The checkpoint directory: what counts as committed, the latest pointer, leftovers,
deletion, and the retention policy (pure, table-driven)."""

import json

import pytest
import torch

from unbroken import Checkpointer
from unbroken.directory import Directory, expired
from unbroken.errors import CheckpointError
from unbroken.format import LATEST, MANIFEST, step_dir
from unbroken.storage import open_storage


@pytest.mark.parametrize(
    ("steps", "keep", "doomed"),
    [
        ([1, 2, 3, 4], None, []),  # keep everything
        ([1, 2, 3, 4], 2, [1, 2]),
        ([1, 2], 2, []),
        ([1], 3, []),  # fewer than keep
        ([], 1, []),
        ([5, 9, 12], 1, [5, 9]),
    ],
)
def test_retention_deletes_all_but_the_newest(steps, keep, doomed):
    assert expired(steps, keep) == doomed


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


def test_retain_deletes_the_oldest_steps_whole(directory, tmp_path):
    assert directory.retain(2) == [1]
    assert directory.steps() == [2, 3] and not (tmp_path / step_dir(1)).exists()
    assert directory.retain(None) == []
    assert directory.manifest().step == 3
    assert not (tmp_path / step_dir(1) / MANIFEST).exists()


def test_a_missing_step_names_the_committed_ones(directory):
    with pytest.raises(
        CheckpointError, match="no committed checkpoint for step 9; committed steps: 1, 2, 3"
    ):
        directory.manifest(9)
    with pytest.raises(CheckpointError, match="committed by another writer meanwhile"):
        directory.commit(directory.manifest(3))


def test_keeping_everything_costs_no_listing(tmp_path):
    """Retention runs after every save: with keep=None it must not list the directory
    (a LIST and a HEAD per step on object stores)."""

    class NoListing:
        def __init__(self, storage):
            self.storage = storage

        def __getattr__(self, name):
            return getattr(self.storage, name)

        def list(self, path):
            raise AssertionError(f"listed {path!r}")

    directory = Directory(NoListing(open_storage(str(tmp_path))), str(tmp_path))
    assert directory.retain(None) == []
