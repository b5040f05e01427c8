import random

import numpy as np
import pytest
import torch

import unbroken
from unbroken.errors import CheckpointError
from unbroken.state import capture
from unbroken.tree import decode, tensor_keys


def test_public_api_is_small_and_importable():
    assert sorted(unbroken.__all__) == [
        "CheckpointError",
        "Checkpointer",
        "CorruptCheckpointError",
        "Origin",
        "PendingSave",
        "PerRank",
        "Progress",
        "RNGState",
        "Restored",
        "Stateful",
    ]
    from unbroken import Checkpointer, Origin, Restored, RNGState  # noqa: F401


def test_capture_roundtrips_tuples_int_keys_and_tensors():
    t = torch.arange(3.0)
    state = {"a": {"x": (1, 2.5, None), 3: [True, "s", t], "__odd": 1}, "b": 7}
    tensors, tree = capture(state)
    assert list(tensors) == ["a/3/2"] and tensors["a/3/2"] is t
    assert tensor_keys(tree) == ["a/3/2"]
    back = {name: decode(enc, tensors) for name, enc in tree.items()}
    assert back == {"a": {"x": (1, 2.5, None), 3: [True, "s", t], "__odd": 1}, "b": 7}
    assert isinstance(back["a"]["x"], tuple) and 3 in back["a"]


def test_capture_rejects_values_that_are_not_json_naming_the_path():
    with pytest.raises(CheckpointError, match=r"opt/param_groups/0/device is a torch.device"):
        capture({"opt": {"param_groups": [{"device": torch.device("cpu")}]}})
    with pytest.raises(CheckpointError, match="must be a non-empty string without '/'"):
        capture({"a/b": 1})


def test_stateful_objects_are_captured_through_state_dict():
    progress = unbroken.Progress(step=3, epoch=1)
    assert isinstance(progress, unbroken.Stateful)
    _, tree = capture({"progress": progress})
    assert tree == {"progress": {"step": 3, "epoch": 1}}


def test_rng_state_restores_every_stream_exactly():
    rng = unbroken.RNGState()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    _, tree = capture({"rng": rng})  # JSON only: no tensors in the manifest's objects
    saved = decode(tree["rng"], {})
    draws = (random.random(), np.random.rand(4).tolist(), torch.rand(4).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    rng.load_state_dict(saved)
    assert (random.random(), np.random.rand(4).tolist(), torch.rand(4).tolist()) == draws


def test_progress_is_a_namespace_of_counters():
    p = unbroken.Progress(step=0)
    p.step += 2
    p.load_state_dict({"step": 10, "batch": 4})
    assert (p.step, p.batch) == (10, 4)
    with pytest.raises(AttributeError, match="no counter 'epoch'"):
        _ = p.epoch
