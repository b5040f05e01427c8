"""Automatic fall-back: a restore passes over a damaged copy (checksum, truncated or
missing file; in memory, a peer's replica, or storage) for the newest older one that
verifies, loudly, with an event; or raises (``fallback=False``, an explicit step,
nothing verifies), leaving the state exactly as it was."""

import glob
import json
import os

import pytest
import torch

import unbroken
from conftest import make_model, train_steps
from ranks import run_ranks
from unbroken import Checkpointer, CorruptCheckpointError
from unbroken.format.layout import step_dir
from unbroken.memory.paths import folder_name
from unbroken.run import contract, worker


def _state(seed=0):
    model = make_model(seed)
    optim = torch.optim.Adam(model.parameters())
    return {"model": model, "optim": optim, "p": unbroken.Progress(step=0), "ema": torch.zeros(4)}


def _tensors(state):
    out = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    out["ema"] = state["ema"].clone()
    return out


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def events(tmp_path, monkeypatch):
    """The events this process records (as under `unbroken run`)."""
    folder = tmp_path / "events"
    folder.mkdir()
    monkeypatch.setenv(contract.HEARTBEAT_DIR_ENV, str(folder))
    worker.reset()

    def read():
        lines = []
        for file in glob.glob(str(folder / "events-*")):
            with open(file) as f:
                lines += [json.loads(x) for x in f]
        return [e for e in lines if e["event"] == "fallback"]

    yield read
    monkeypatch.delenv(contract.HEARTBEAT_DIR_ENV)
    worker.reset()


@pytest.fixture
def saved(tmp_path):
    """Steps 1, 2, 3 on storage; the tensors of each."""
    ckpt, state, seen = Checkpointer(tmp_path / "ckpt"), _state(), {}
    for step in (1, 2, 3):
        train_steps(state["model"], state["optim"], 1)
        state["ema"].add_(1)
        state["p"].step = step
        ckpt.save(step, state)
        seen[step] = _tensors(state)
    ckpt.close()
    return tmp_path / "ckpt", seen


def _data(path, step):
    return path / step_dir(step) / "r00000-000.safetensors"


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))


def _flip_last_byte(file):
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 0xFF  # the last tensor's data: the ones before it are read first
    file.write_bytes(raw)


DAMAGE = {
    "checksum": _flip_last_byte,
    "truncated": lambda f: os.truncate(f, f.stat().st_size - 1),
    "missing": os.remove,
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_newest_step_falls_back_to_the_newest_good_one(saved, events, how, caplog):
    path, seen = saved
    DAMAGE[how](_data(path, 3))
    state = _state(seed=5)
    ckpt = Checkpointer(path)
    assert ckpt.restore(state) == 2
    assert _equal(_tensors(state), seen[2]) and state["p"].step == 2
    assert ckpt.last_restore is not None
    assert [(o.kind, o.step) for o in ckpt.last_restore.damaged] == [("storage", 3)]
    assert "step 3 is damaged" in caplog.text and "falling back" in caplog.text
    assert str(_data(path, 3).name) in caplog.text or "missing" in caplog.text
    [event] = events()
    assert event["step"] == 3 and event["tier"] == "storage"


@pytest.mark.parametrize("how", DAMAGE)
def test_without_fallback_a_damaged_step_raises_and_changes_nothing(saved, events, how):
    path, _ = saved
    DAMAGE[how](_data(path, 3))
    state = _state(seed=5)
    train_steps(state["model"], state["optim"], 1)  # optimizer state exists: it is kept too
    before = _tensors(state)
    optim_before = {k: v.clone() for k, v in state["optim"].state[state["model"][0].weight].items()}
    with pytest.raises(CorruptCheckpointError, match=step_dir(3)):
        Checkpointer(path).restore(state, fallback=False)
    assert _equal(_tensors(state), before) and state["p"].step == 0
    after = state["optim"].state[state["model"][0].weight]
    assert all(torch.equal(after[k], v) for k, v in optim_before.items())
    assert events() == []


def test_an_explicit_step_never_falls_back(saved):
    path, _ = saved
    _flip_last_byte(_data(path, 2))
    state = _state(seed=5)
    before = _tensors(state)
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        Checkpointer(path).restore(state, step=2)
    assert _equal(_tensors(state), before)


def test_when_nothing_verifies_the_error_names_every_damaged_step(saved, events):
    path, _ = saved
    for step in (1, 2, 3):
        _flip_last_byte(_data(path, step))
    state = _state(seed=5)
    before = _tensors(state)
    with pytest.raises(CorruptCheckpointError, match="no checkpoint verifies") as error:
        Checkpointer(path).restore(state)
    assert all(f"step {s} (storage)" in str(error.value) for s in (1, 2, 3))
    assert _equal(_tensors(state), before)
    assert [e["step"] for e in events()] == [3, 2, 1]


def test_a_damaged_memory_snapshot_falls_back_to_storage(tmp_path, events):
    def make():
        return Checkpointer(tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "shm"))

    ckpt, state = make(), _state()
    ckpt.save(2, state)
    expected = _tensors(state)
    train_steps(state["model"], state["optim"], 1)
    ckpt.snapshot(3, state)
    ckpt.close()
    [data] = glob.glob(str(tmp_path / "shm" / "*" / "rank-00000" / "slot-*.bin"))
    _flip(data, 10)
    fresh = _state(seed=5)
    restored = make()
    assert restored.restore(fresh) == 2
    assert restored.last_restore.origin.kind == "storage"
    assert _equal(_tensors(fresh), expected)
    assert [(e["step"], e["tier"]) for e in events()] == [(3, "memory")]


def _replica_damaged_job(rank: int, world: int, root: str) -> dict:
    """2 ranks on 2 simulated nodes: node 1 is lost, and node 0's replica of it is
    damaged: every rank falls back past memory and replicas to storage."""
    import shutil

    os.environ[contract.NODE_ENV] = str(rank)
    shm = os.path.join(root, f"node-{rank}")

    def make() -> Checkpointer:
        return Checkpointer(
            os.path.join(root, "ckpt"), memory=True, replicas=1, memory_dir=shm, job="j"
        )

    ckpt = make()
    state = {"w": torch.full((100,), float(rank))}
    ckpt.save(2, state)
    state["w"] += 1
    ckpt.snapshot(3, state)
    ckpt.wait()
    if rank == 1:
        shutil.rmtree(shm)
        state = {"w": torch.zeros(100)}
        [data] = glob.glob(
            os.path.join(root, "node-0", folder_name("j"), "replicas", "rank-00001", "*.bin")
        )
        _flip(data, 10)
    replacement = make()
    step = replacement.restore(state)
    assert replacement.last_restore is not None
    return {
        "step": step,
        "w": state["w"][0].item(),
        "origin": replacement.last_restore.origin.kind,
    }


@pytest.mark.timeout(120)
def test_a_damaged_peer_replica_falls_back_to_storage(tmp_path):
    results = run_ranks(_replica_damaged_job, str(tmp_path), timeout=90)
    assert results == [
        {"step": 2, "w": 0.0, "origin": "storage"},
        {"step": 2, "w": 1.0, "origin": "storage"},
    ]
