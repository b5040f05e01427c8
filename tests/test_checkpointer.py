"""Single-process behaviour: commit rule, checksums, bad input, retention."""

import json
import os

import pytest
import torch

import unbroken
from conftest import make_model, train_steps
from unbroken import Checkpointer, CheckpointError, CorruptCheckpointError
from unbroken.format.layout import MANIFEST, VERSION, step_dir
from unbroken.memory.tier import OWN_SLOTS


def _state(seed=0):
    model = make_model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": unbroken.RNGState(),
        "progress": unbroken.Progress(step=0),
        "ema": torch.zeros(4),
        "config": {"lr": 0.01, "layers": (8, 16, 4)},
    }


def _train(state, n):
    for _ in range(n):
        train_steps(state["model"], state["optim"], 1)
        state["sched"].step()
        state["progress"].step += 1
        state["ema"].add_(1)


def _params(state):
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def test_restore_then_continue_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    state = _state()
    _train(state, 3)
    Checkpointer(tmp_path).save(3, state)
    saved_sched = state["sched"].state_dict()
    _train(state, 4)
    expected = _params(state)

    fresh = _state(seed=99)  # different init, no optimizer state yet
    fresh["config"] = None
    assert Checkpointer(tmp_path).restore(fresh) == 3
    assert fresh["progress"].step == 3 and fresh["config"] == {"lr": 0.01, "layers": (8, 16, 4)}
    assert torch.equal(fresh["ema"], torch.full((4,), 3.0))
    assert fresh["sched"].state_dict() == saved_sched
    _train(fresh, 4)
    got = _params(fresh)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_restore_reads_into_the_existing_parameters(tmp_path):
    state = _state()
    Checkpointer(tmp_path).save(0, state)
    fresh = _state(seed=5)
    weight = fresh["model"][0].weight
    pointer = weight.data_ptr()
    Checkpointer(tmp_path).restore(fresh)
    assert weight.data_ptr() == pointer and torch.equal(weight, state["model"][0].weight)


def test_restore_with_nothing_saved_returns_none_and_touches_nothing(tmp_path):
    state = _state()
    before = _params(state)
    assert Checkpointer(tmp_path / "new").restore(state) is None
    assert all(torch.equal(v, before[k]) for k, v in _params(state).items())


def test_restore_a_given_step(tmp_path):
    ckpt = Checkpointer(tmp_path)
    state = _state()
    ckpt.save(1, state)
    _train(state, 1)
    ckpt.save(2, state)
    assert ckpt.steps() == [1, 2]
    fresh = _state()
    assert ckpt.restore(fresh, step=1) == 1 and fresh["progress"].step == 0


def test_an_uncommitted_directory_is_invisible_and_cleaned_up_by_the_next_job(tmp_path):
    ckpt = Checkpointer(tmp_path)
    state = _state()
    ckpt.save(1, state)
    os.makedirs(tmp_path / step_dir(2))
    (tmp_path / step_dir(2) / "r00000-000.safetensors").write_bytes(b"partial")
    assert ckpt.steps() == [1]
    assert ckpt.restore(_state()) == 1
    ckpt.save(3, state)  # saves list once: a crash's leftovers wait for the next job
    assert step_dir(2) in os.listdir(tmp_path)
    ckpt.close()
    reopened = Checkpointer(tmp_path)
    reopened.save(4, state)  # its first save lists, and removes them
    assert sorted(os.listdir(tmp_path)) == ["latest", step_dir(1), step_dir(3), step_dir(4)]


def test_a_committed_step_is_never_overwritten(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, _state())
    before = (tmp_path / step_dir(1) / MANIFEST).read_bytes()
    with pytest.raises(CheckpointError, match="step 1 is already committed"):
        ckpt.save(1, _state(seed=3))
    assert (tmp_path / step_dir(1) / MANIFEST).read_bytes() == before


class FailingStorage:
    """A storage whose data writes fail, as a full disk would."""

    def __init__(self, inner):
        self.inner = inner

    def write(self, path, parts):
        raise OSError(28, "No space left on device", path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_failed_save_leaves_the_last_good_checkpoint_intact(tmp_path):
    ckpt = Checkpointer(tmp_path)
    state = _state()
    ckpt.save(1, state)
    expected = _params(state)
    _train(state, 2)
    ckpt.storage = FailingStorage(ckpt.storage)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(3, state)
    with pytest.raises(CheckpointError, match=r"is a torch\.dtype"):
        ckpt.save(4, {**state, "bad": torch.float32})
    ckpt = Checkpointer(tmp_path)
    assert ckpt.steps() == [1]
    fresh = _state(seed=7)
    assert ckpt.restore(fresh) == 1
    assert all(torch.equal(v, expected[k]) for k, v in _params(fresh).items())


def test_a_flipped_byte_is_caught_naming_file_tensor_and_step(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(7, _state())
    manifest = ckpt.manifest(7)
    chunk = manifest.tensors["model/0.weight"].chunks[0]
    path = tmp_path / step_dir(7) / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.start + 5] ^= 0xFF
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpointError) as info:
        ckpt.restore(_state())
    assert all(
        s in str(info.value) for s in ("step-000000007", chunk.file, "'model/0.weight'", "checksum")
    )


# -- bad input: a clear error, and nothing in the state changes ------------------------


@pytest.fixture
def saved(tmp_path):
    state = _state()
    _train(state, 2)
    Checkpointer(tmp_path).save(2, state)
    return tmp_path


def _restore_fails(path, state, match, **kwargs):
    before = _params(state)
    with pytest.raises(CheckpointError, match=match):
        Checkpointer(path).restore(state, **kwargs)
    assert all(torch.equal(v, before[k]) for k, v in _params(state).items())


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        Checkpointer(tmp_path / "f")


def test_requested_step_does_not_exist(saved):
    _restore_fails(
        saved, _state(), r"no committed checkpoint for step 5; committed steps: 2", step=5
    )


def test_manifest_from_a_newer_format_version(saved):
    path = saved / step_dir(2) / MANIFEST
    raw = json.loads(path.read_text())
    raw["version"] = VERSION + 1
    path.write_text(json.dumps(raw))
    _restore_fails(saved, _state(), f"format version {VERSION + 1}, newer than this unbroken reads")


def test_truncated_shard_file(saved):
    shard = next((saved / step_dir(2)).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    _restore_fails(saved, _state(), f"{shard.name} is .* bytes but was written with .*truncated")


def test_checkpoint_has_keys_the_model_lacks(saved):
    state = _state()
    state["model"] = torch.nn.Sequential(torch.nn.Linear(8, 16))
    state["optim"] = torch.optim.AdamW(state["model"].parameters())
    state["sched"] = torch.optim.lr_scheduler.StepLR(state["optim"], 2)
    _restore_fails(saved, state, r"in the checkpoint but not in the state: \['model/2.bias'")
    del state["optim"], state["sched"]
    assert Checkpointer(saved).restore(state, strict=False) == 2
    assert torch.equal(state["model"][0].weight, _saved_weight(saved))


def test_model_has_keys_the_checkpoint_lacks(saved):
    state = _state()
    state["model"].add_module("extra", torch.nn.Linear(4, 4))
    state["new_entry"] = unbroken.Progress(x=1)
    _restore_fails(saved, state, r"missing from the checkpoint: \['new_entry'\]")
    del state["new_entry"]
    _restore_fails(saved, state, r"missing from the checkpoint: \['model/extra.bias'")
    extra = state["model"].extra.weight.clone()
    assert Checkpointer(saved).restore(state, strict=False) == 2
    assert torch.equal(state["model"].extra.weight, extra)
    assert torch.equal(state["model"][0].weight, _saved_weight(saved))


def test_shape_mismatch(saved):
    state = _state()
    state["ema"] = torch.zeros(5)
    _restore_fails(saved, state, r"'ema' has shape \[4\] in the checkpoint but \[5\] in the state")


def _saved_weight(path):
    fresh = _state(seed=1)
    Checkpointer(path).restore(fresh)
    return fresh["model"][0].weight


def test_keep_retains_the_newest_checkpoints(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    state = _state()
    for step in range(1, 5):
        ckpt.save(step, state)
    ckpt.wait()  # deletion runs in the background
    assert ckpt.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["latest", step_dir(3), step_dir(4)]


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"keep": 0}, "keep at least 1"), ({"io_threads": 0}, "at least one")]
)
def test_bad_options_say_why(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Checkpointer(tmp_path, **kwargs)


def test_a_step_below_the_newest_committed_one_is_refused(tmp_path):
    ckpt = Checkpointer(tmp_path)
    state = _state()
    ckpt.save(5, state)
    with pytest.raises(CheckpointError, match="step 3 is below the newest committed step 5"):
        ckpt.save(3, state)
    assert ckpt.steps() == [5] and ckpt._directory.latest() == 5
    assert Checkpointer(tmp_path).restore(_state()) == 5


def test_a_job_that_rolls_back_retires_the_abandoned_steps(tmp_path):
    """The rule (README, "Steps that go backwards"): restoring an older step, then saving,
    retires the steps above the restored one; `latest` and `restore()` then give the
    newest step of the new run, and retention counts only its steps."""
    ckpt = Checkpointer(tmp_path, keep=3)
    state = _state()
    for step in range(1, 6):
        _train(state, 1)
        ckpt.save(step, state)
    ckpt.wait()
    assert ckpt.steps() == [3, 4, 5]
    rolled = _state(seed=3)
    assert ckpt.restore(rolled, step=3) == 3  # back before a loss spike
    _train(rolled, 2)
    ckpt.save(4, rolled)  # a step the abandoned run also saved
    ckpt.wait()
    assert ckpt.steps() == [3, 4] and ckpt._directory.latest() == 4
    fresh = _state(seed=9)
    assert Checkpointer(tmp_path).restore(fresh) == 4
    assert all(
        torch.equal(a, b)
        for a, b in zip(_params(fresh).values(), _params(rolled).values(), strict=True)
    )
    ckpt.save(5, rolled)  # once: later saves retire nothing
    ckpt.save(6, rolled)
    ckpt.wait()
    assert ckpt.steps() == [4, 5, 6]


def test_step_takes_what_the_policy_says(tmp_path):
    from unbroken.policies import Every, Policy

    policy = Policy(snapshot=Every(steps=2), save=Every(steps=5), blocking=True)
    ckpt = Checkpointer(
        tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "shm"), policy=policy
    )
    state = _state()
    for step in range(1, 11):
        _train(state, 1)
        ckpt.step(step, state)
    ckpt.save(11, state)  # the loop may still save by itself
    ckpt.step(11, state)  # and the policy does not save it twice
    ckpt.wait()
    assert ckpt.steps() == [5, 10, 11]
    assert ckpt._memory is not None  # the two newest snapshots (10 was saved), and an
    # older one where 8 came while 6 was still being checksummed (it took the third slot)
    held = sorted(ckpt._memory.snapshots())
    assert held[-2:] == [6, 8] and len(held) <= OWN_SLOTS
