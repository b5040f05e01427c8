"""Real multi-process tests: 2 ranks joined by gloo, each test under a timeout."""

from __future__ import annotations

import json
import os

import pytest

from ranks import run_ranks
from unbroken.format.layout import MANIFEST, step_dir

pytestmark = pytest.mark.timeout(180)
TWO_RANK = True  # tests/test_stress.py runs this file under CPU load


def _ddp_job(rank: int, world: int, path: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import unbroken

    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.Linear(32, 4)))
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        return {
            "model": model,
            "optim": optim,
            "sched": torch.optim.lr_scheduler.StepLR(optim, step_size=2),
            "rng": unbroken.RNGState(),
            "progress": unbroken.Progress(step=0),
            "local": torch.zeros(3),  # differs between ranks: saved once per rank
        }

    def train(state: dict, steps: int) -> None:
        for _ in range(steps):
            loss = state["model"](torch.randn(4, 16)).pow(2).mean()
            state["optim"].zero_grad()
            loss.backward()
            state["optim"].step()
            state["sched"].step()
            state["progress"].step += 1
            state["local"] += rank + 1

    ckpt = unbroken.Checkpointer(path)
    state = build(seed=0)
    torch.manual_seed(100 + rank)  # different data and dropout on each rank
    train(state, 3)
    ckpt.save(3, state)
    train(state, 4)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}

    fresh = build(seed=rank + 7)  # a different init on each rank, empty optimizer state
    torch.manual_seed(12345)  # RNG must come back from the checkpoint, not from here
    restored = ckpt.restore(fresh)
    local = fresh["local"].tolist()
    train(fresh, 4)
    got = fresh["model"].state_dict()
    # The user's own collectives keep working next to the checkpointer's group.
    flag = torch.tensor([1.0])
    dist.all_reduce(flag)
    return {
        "restored": restored,
        "progress": fresh["progress"].step,
        "local": local,
        "equal": all(torch.equal(got[k], expected[k]) for k in expected),
        "allreduce": flag.item(),
    }


def test_ddp_save_restore_continues_bitwise_equal(tmp_path):
    results = run_ranks(_ddp_job, str(tmp_path))
    assert [r["restored"] for r in results] == [3, 3]
    assert [r["progress"] for r in results] == [7, 7]
    assert [r["local"] for r in results] == [[3.0] * 3, [6.0] * 3]
    assert all(r["equal"] for r in results)
    assert [r["allreduce"] for r in results] == [2.0, 2.0]

    manifest = json.loads((tmp_path / step_dir(3) / MANIFEST).read_text())
    assert manifest["world_size"] == 2
    # Replicated parameters and optimizer state are written once, by one of the ranks...
    replicated = {k: e for k, e in manifest["tensors"].items() if k != "local"}
    assert all(len(e["chunks"]) == 1 and "ranks" not in e["chunks"][0] for e in replicated.values())
    # ...and the writing is spread over both ranks.
    writers = {c["file"][:6] for e in replicated.values() for c in e["chunks"]}
    assert writers == {"r00000", "r00001"}
    # The per-rank tensor is stored once per rank, tagged with its rank.
    assert sorted(c["ranks"] for c in manifest["tensors"]["local"]["chunks"]) == [[0], [1]]
    on_disk = sum(os.path.getsize(tmp_path / step_dir(3) / f) for f in manifest["files"])
    tensor_bytes = sum(
        c["end"] - c["start"] for e in manifest["tensors"].values() for c in e["chunks"]
    )
    assert tensor_bytes < on_disk < tensor_bytes + 4096  # one copy plus headers


def _fsdp_job(rank: int, world: int, path: str, how: str = "save") -> dict:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import unbroken

    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # 5 rows: uneven
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.05)

    def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
        for step in range(steps):
            torch.manual_seed(1000 * step + rank)
            loss = model(torch.randn(4, 8)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()

    ckpt = unbroken.Checkpointer(path, memory=how == "snapshot", replicas=how == "snapshot")
    model, optim = build(0)
    train(model, optim, 2)
    if how == "save":  # in the background: the shards' copy waits for the next step
        ckpt.save(2, {"model": model, "optim": optim}, blocking=False)
    else:  # each rank's own shards, in shared memory and on its peer
        ckpt.snapshot(2, {"model": model, "optim": optim})
    train(model, optim, 3)
    ckpt.wait()
    expected = {k: v.full_tensor() for k, v in model.state_dict().items()}

    model, optim = build(rank + 3)
    assert ckpt.restore({"model": model, "optim": optim}) == 2
    train(model, optim, 3)
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    origin = ckpt.last_restore.origin.kind if ckpt.last_restore else None
    ckpt.close()
    return {"equal": all(torch.equal(got[k], expected[k]) for k in expected), "from": origin}


def test_fsdp2_shards_restore_exactly_from_a_memory_snapshot(tmp_path):
    """A rank's snapshot of a sharded tensor holds its own shards, not the whole tensor."""
    results = run_ranks(_fsdp_job, str(tmp_path), "snapshot")
    assert [(r["equal"], r["from"]) for r in results] == [(True, "memory")] * 2


def test_fsdp2_shards_are_saved_with_offsets_and_restore_exactly(tmp_path):
    assert all(r["equal"] for r in run_ranks(_fsdp_job, str(tmp_path)))
    manifest = json.loads((tmp_path / step_dir(2) / MANIFEST).read_text())
    weight = manifest["tensors"]["model/2.weight"]
    assert weight["shape"] == [5, 16]
    assert [(c["offsets"], c["shape"]) for c in weight["chunks"]] == [
        ([0, 0], [3, 16]),
        ([3, 0], [2, 16]),
    ]
    assert {c["file"][:6] for c in weight["chunks"]} == {"r00000", "r00001"}


def _bad_saves_job(rank: int, world: int, path: str) -> list[str]:
    import torch

    import unbroken

    ckpt = unbroken.Checkpointer(path)
    state = {"w": torch.ones(4)}
    ckpt.save(1, state)
    errors = []
    try:  # ranks disagree on the step
        ckpt.save(2 + rank, state)
    except unbroken.CheckpointError as e:
        errors.append(str(e))
    try:  # one rank's state cannot be saved: both ranks raise, nothing is committed
        ckpt.save(5, {**state, "bad": object()} if rank == 1 else state)
    except unbroken.CheckpointError as e:
        errors.append(str(e))
    for step in (1 if rank == 0 else 9, 9):  # ranks disagree; the step does not exist
        try:
            ckpt.restore(state, step=step)
        except unbroken.CheckpointError as e:
            errors.append(str(e))
    ckpt.save(6, {"w": torch.full((4,), 2.0)})  # the group still works after failures
    state["w"].zero_()
    errors.append(str(ckpt.restore(state)) + f" {state['w'].tolist()} {ckpt.steps()}")
    return errors


def test_failures_on_one_rank_fail_every_rank_and_commit_nothing(tmp_path):
    r0, r1 = run_ranks(_bad_saves_job, str(tmp_path))
    assert "ranks disagree on the step to save: {0: 2, 1: 3}" in r0[0] and r0[0] == r1[0]
    assert "failed on another rank: rank 1: bad is a builtins.object" in r0[1]
    assert r1[1].startswith("bad is a builtins.object")
    assert "ranks disagree on the step to restore: {0: 1, 1: 9}" in r0[2] and r0[2] == r1[2]
    assert "has no committed checkpoint for step 9; committed steps: 1" in r0[3]
    assert r1[3].startswith("finding a checkpoint failed on another rank: rank 0: ")
    assert r0[4] == r1[4] == "6 [2.0, 2.0, 2.0, 2.0] [1, 6]"


class CountingReads:
    """Counts the bytes fetched from storage."""

    def __init__(self, inner):
        self.inner, self.reads = inner, 0

    def read_into(self, path, offset, out):
        self.reads += len(out)
        return self.inner.read_into(path, offset, out)

    def read_range(self, path, offset, length):
        self.reads += length
        return self.inner.read_range(path, offset, length)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _replicated_reads_job(rank: int, world: int, path: str) -> dict:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import unbroken

    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)))
        optim = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 16)).sum().backward()
        optim.step()
        return {"model": model, "optim": optim, "local": torch.full((2,), float(rank))}

    saved = build(0)
    unbroken.Checkpointer(path).save(1, saved)
    expected = {k: v.clone() for k, v in saved["model"].state_dict().items()}
    out = {}
    reads = {}
    for mode in ("each", "broadcast", "slice"):
        state = build(rank + 5)
        state["optim"] = torch.optim.Adam(state["model"].parameters())  # no state yet
        ckpt = unbroken.Checkpointer(path, replicated_reads=mode)
        ckpt.storage = counting = CountingReads(ckpt.storage)
        assert ckpt.restore(state) == 1
        reads[mode] = counting.reads
        got = state["model"].state_dict()
        exp_avg = state["optim"].state_dict()["state"][0]["exp_avg"]
        out[mode] = (
            all(torch.equal(got[k], expected[k]) for k in expected)
            and torch.equal(exp_avg, saved["optim"].state_dict()["state"][0]["exp_avg"])
            and state["local"].tolist() == [float(rank)] * 2
        )
    out["reads"] = reads
    return out


def test_replicated_tensors_read_once_and_broadcast_restore_the_same(tmp_path):
    r0, r1 = run_ranks(_replicated_reads_job, str(tmp_path))
    for result in (r0, r1):
        assert (result["each"], result["broadcast"], result["slice"]) == (True, True, True)
    # Parameters (676 floats), Adam's two moments and 4 step counters are the same on
    # both ranks; "local" (2 floats) differs per rank.
    shared, local = (676 * 3 + 4) * 4, 2 * 4
    assert r0["reads"] == {
        "each": shared + local,
        "broadcast": shared + local,
        "slice": r0["reads"]["slice"],
    }
    assert r1["reads"]["each"] == shared + local
    assert r1["reads"]["broadcast"] == local  # only its own "local"
    assert r0["reads"]["slice"] + r1["reads"]["slice"] == shared + 2 * local  # shared once
    assert local < r1["reads"]["slice"] < shared
