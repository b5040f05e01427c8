"""Megatron Core's ``dist_checkpointing.save`` / ``load`` through unbroken.megatron's
strategies, on real gloo ranks with a real GPTModel: a tensor-parallel (TP=2) model's
sharded state dict round trips bitwise, loads into a TP=1 model in one process
(resharding), a corrupt block is found on load, a committed step is never replaced."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ranks import run_ranks
from unbroken.cli.main import main as cli

# Three interpreters import megatron.core (~7 s of CPU each, more on a loaded machine).
pytestmark = pytest.mark.timeout(300)

STEP = 7
FLIPPED = "embedding.word_embeddings.weight"


def gpt(tp: int, seed: int) -> torch.nn.Module:
    """A two-layer GPTModel on the CPU, its linear layers split over ``tp`` ranks."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True
    )
    spec = get_gpt_layer_local_spec()
    return GPTModel(config, spec, vocab_size=64, max_sequence_length=16)


def tensors(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's tensors as arrays: a tensor sent back from a rank would be shared
    through a file descriptor of a process that has exited by the time it is read."""
    return {
        k: v.detach().numpy().copy()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


def state(model: torch.nn.Module, rank: int, world: int, sampler: Any) -> dict[str, Any]:
    """Megatron's sharded state dict of ``model``, one ShardedObject per rank (a data
    position) and plain common state."""
    from megatron.core.dist_checkpointing import ShardedObject

    return {
        "model": model.sharded_state_dict(),  # type: ignore[operator]
        "sampler": ShardedObject("sampler", sampler, (world,), (rank,)),
        "config": {"lr": 0.25, "iteration": STEP},
    }


def _flip(folder: Path, prefix: str) -> str:
    """Flip one byte inside the first stored block named ``prefix...``; its file."""
    for file in sorted(folder.glob("*.safetensors")):
        raw = bytearray(file.read_bytes())
        (size,) = struct.unpack("<Q", raw[:8])
        for name, entry in json.loads(raw[8 : 8 + size]).items():
            if name.startswith(prefix):
                raw[8 + size + entry["data_offsets"][0]] ^= 0xFF
                file.write_bytes(bytes(raw))
                return file.name
    raise AssertionError(f"no block of {prefix} in {folder}")


def _save_load_corrupt(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    import unbroken.megatron

    ckpt = os.path.join(root, "iter_0000007")
    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    saved = gpt(tp=world, seed=0)
    save = unbroken.megatron.SaveStrategy(step=STEP)
    dist_checkpointing.save(state(saved, rank, world, {"rank": rank}), ckpt, sharded_strategy=save)

    fresh = gpt(tp=world, seed=1)  # other values everywhere
    load = unbroken.megatron.LoadStrategy()
    got = dist_checkpointing.load(state(fresh, rank, world, None), ckpt, sharded_strategy=load)
    fresh.load_state_dict(got["model"])
    want = tensors(saved)
    out: dict[str, Any] = {
        "local": want,
        "bitwise": [k for k, v in tensors(fresh).items() if not np.array_equal(v, want[k])],
        "sampler": got["sampler"],
        "config": got["config"],
        "shapes": {k: list(v.global_shape) for k, v in load.load_tensors_metadata(ckpt).items()},
    }
    try:  # a committed step is never replaced
        dist_checkpointing.save(
            state(saved, rank, world, {"rank": rank}), ckpt, sharded_strategy=save
        )
    except CheckpointException as e:
        out["again"] = str(e)
    dist.barrier()
    if rank == 0:  # an intact copy for the TP=1 load, then corrupt the original
        shutil.copytree(ckpt, os.path.join(root, "intact"))
        _flip(Path(ckpt) / f"step-{STEP:09d}", FLIPPED)
    dist.barrier()
    try:
        dist_checkpointing.load(
            state(gpt(tp=world, seed=1), rank, world, None), ckpt, sharded_strategy=load
        )
    except CheckpointException as e:
        out["corrupt"] = " ".join(repr(f) for f in e.failures.values())
    return out


def _load_tp1(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    import unbroken.megatron

    model = gpt(tp=1, seed=1)
    got = dist_checkpointing.load(
        {"model": model.sharded_state_dict()},  # type: ignore[operator]
        ckpt,
        sharded_strategy=unbroken.megatron.LoadStrategy(step=STEP),
    )
    model.load_state_dict(got["model"])
    return {"tensors": tensors(model), "config": got["config"]}


def joined(parts: list[np.ndarray], whole: np.ndarray) -> np.ndarray:
    """The TP=1 tensor that TP-local ``parts`` form: joined along the one dimension
    where their shape differs from ``whole``'s, or (replicated) the first part."""
    for dim, (part, size) in enumerate(zip(parts[0].shape, whole.shape, strict=True)):
        if part != size:
            return np.concatenate(parts, dim)
    return parts[0]


def test_gpt_tp2_save_load_reshard_and_corrupt_block(tmp_path: Path) -> None:
    results = run_ranks(_save_load_corrupt, str(tmp_path), world=2, timeout=200)
    for rank, r in enumerate(results):
        assert r["bitwise"] == [], (rank, r["bitwise"])
        assert r["sampler"] == {"rank": rank}
        assert r["config"] == {"lr": 0.25, "iteration": STEP}
        assert r["shapes"][FLIPPED] == [64, 32]
        assert "already committed" in r["again"], r["again"]
        # every rank fails the load; the failure of the rank that read the block says why
        assert "CorruptCheckpointError" in r["corrupt"] and FLIPPED in r["corrupt"]
    ckpt = tmp_path / "iter_0000007"
    assert sorted(os.listdir(ckpt)) == ["common.pt", "latest", "metadata.json", f"step-{STEP:09d}"]
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "unbroken"
    assert cli(["verify", str(tmp_path / "intact")]) == 0  # an ordinary unbroken step
    assert cli(["verify", str(ckpt)]) != 0

    # saved by 2 tensor-parallel ranks, loaded into one unsplit model: DCP's planner reads
    # each tensor's blocks from both ranks' files
    (one,) = run_ranks(_load_tp1, str(tmp_path / "intact"), world=1, timeout=90)
    assert one["config"]["lr"] == 0.25
    whole = one["tensors"]
    assert whole.keys() == results[0]["local"].keys()
    split = [k for k in whole if results[0]["local"][k].shape != whole[k].shape]
    assert FLIPPED in split and len(split) > 4, split  # the test does exercise resharding
    for key, value in whole.items():
        parts = [r["local"][key] for r in results]
        assert np.array_equal(value, joined(parts, value)), key


def test_async_save_is_refused() -> None:
    import unbroken.megatron
    from unbroken.errors import CheckpointError

    with pytest.raises(CheckpointError, match="async_sharded_save=False"):
        unbroken.megatron.SaveStrategy().async_save({}, "unused")
    with pytest.raises(ValueError, match="numbered from 0"):
        unbroken.megatron.SaveStrategy(step=-1)
    with pytest.raises(CheckpointError, match="'torch_dist' backend"):
        unbroken.megatron.LoadStrategy().check_backend_compatibility("torch_dist")
