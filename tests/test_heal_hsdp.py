"""Healing the replica dimension of HSDP: FSDP2's `fully_shard` on a 2-D CPU mesh
(replicate x shard) over gloo, 4 ranks. A replacement receives its shard's live state
from the rank holding the same shard in another replica group; where no live rank holds
a lost shard, healing refuses and the snapshot path restores.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch import nn

from test_heal import table
from unbroken.healing import live, plan, records
from unbroken.healing.records import Record


def test_plan_takes_a_lost_ranks_source_among_the_ranks_holding_its_shard():
    """HSDP on a 2x2 mesh: ranks 0 and 2 hold one shard, 1 and 3 the other."""
    peers = [[0, 2], [1, 3], [0, 2], [1, 3]]
    rows = table((None, {}), (None, {}), (5, {0: [5]}), (5, {1: [5]}))
    chosen = plan.plan([{**row, "peers": p} for row, p in zip(rows, peers, strict=True)])
    assert chosen == plan.Plan(step=5, source={0: 2, 1: 3}, holder={0: 2, 1: 3})
    # Both holders of shard 0 lost: no live replica, the snapshot path restores.
    rows = table((None, {}), (5, {0: [5]}), (None, {}), (5, {2: [5]}))
    assert plan.plan([{**row, "peers": p} for row, p in zip(rows, peers, strict=True)]) is None


@pytest.mark.timeout(120)
def test_hsdp_replacements_heal_from_their_shard_peers_bitwise():
    """FSDP2 (`fully_shard`) on a 2-D CPU mesh, replicate x shard, 4 gloo ranks: replica
    group {0, 1} is lost (a node); each replacement, built fresh, receives its shard's
    live model and optimizer state from the rank holding the same shard in the other
    group, in place, and the run ends bitwise equal to an uninterrupted one. Then both
    holders of one shard are lost: healing refuses, changing nothing."""
    from ranks import run_ranks

    job = f"hsdp-{os.getpid()}-{random.random()}"
    results = run_ranks(_hsdp_job, job, world=4, timeout=110)
    assert results == [(3, True, True, True, None)] * 4


def _hsdp_job(rank: int, world: int, job: str) -> tuple:
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    from unbroken.healing.peers import local
    from unbroken.job.comm import Comm
    from unbroken.state import capture

    comm = Comm(None, timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build(seed: int) -> dict:
        return _hsdp_state(mesh, seed)

    def train(state: dict, step: int) -> None:
        _hsdp_step(comm, job, state, step)

    def held(state: dict) -> list[torch.Tensor]:
        tensors, _ = capture({"model": state["model"], "optim": state["optim"]})
        return [local(tensors[k]).clone() for k in sorted(tensors)]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    reference = build(0)
    for step in range(1, 6):
        train(reference, step)
    records.forget(job)
    state = build(0)
    for step in range(1, 4):
        train(state, step)
    before = held(state)
    if rank in (0, 1):  # replica group 0 lost: replacements, fresh, holding nothing
        records.forget(job)
        state = build(99)
    healed = live.heal(comm, job, state, capture(state))
    at = None if healed is None else healed[0].step
    ok = same(held(state), before) and state["progress"] == {"step": 3}
    for step in (4, 5):
        train(state, step)
    bitwise = same(held(state), held(reference))
    # Ranks 0 and 2 (both holders of shard 0) lost: no live replica of it.
    now = held(state)
    if rank in (0, 2):
        records.forget(job)
        state = build(7)
        now = held(state)
    refused = live.heal(comm, job, state, capture(state))
    untouched = same(held(state), now)
    return at, ok, bitwise, untouched, refused


def _hsdp_state(mesh: object, seed: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)  # type: ignore[call-overload]
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    return {"model": model, "optim": optim, "progress": {"step": 0}}


def _hsdp_step(comm: object, job: str, state: dict, step: int) -> None:
    """One training step on this rank's own data, and its record sent to two peers."""
    rank, world = comm.rank, comm.world_size  # type: ignore[attr-defined]
    torch.manual_seed(1000 * step + rank)
    state["optim"].zero_grad()
    state["model"](torch.randn(4, 8)).pow(2).sum().backward()
    state["optim"].step()
    state["progress"] = {"step": step}
    record = Record.make(step, rank, state, layouts={}, data_parallel=False)
    records.keep_own(job, record)
    others = [(rank + 1) % world, (rank + 2) % world]
    got = records.exchange(comm, dict.fromkeys(others, record.data),  # type: ignore[arg-type]
                           [(rank - 1) % world, (rank - 2) % world])  # fmt: skip
    for owner, data in got.items():
        records.keep_held(job, owner, step, data)


@pytest.mark.timeout(120)
def test_a_checkpointer_heals_a_lost_replica_group_from_live_shards(tmp_path):
    """The same through `Checkpointer.step` and `restore` (records sent to the other
    simulated node): the lost node's ranks restore from ranks 2 and 3, origin "live"."""
    from ranks import run_ranks

    origins = [("live", 2), ("live", 3), ("live", None), ("live", None)]
    assert (
        run_ranks(_checkpointer_job, str(tmp_path), world=4, timeout=110)
        == [(3, origins, True)] * 4
    )


def _checkpointer_job(rank: int, world: int, where: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    from unbroken import Checkpointer
    from unbroken.healing.peers import local
    from unbroken.run import contract

    os.environ[contract.NODE_ENV] = str(rank // 2)  # nodes {0, 1} and {2, 3}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    state = _hsdp_state(mesh, 0)
    ckpt = Checkpointer(f"{where}/ckpt", memory_dir=f"{where}/shm-{rank // 2}")
    for step in range(1, 4):
        torch.manual_seed(10 * step + rank)
        state["optim"].zero_grad()
        state["model"](torch.randn(2, 8)).sum().backward()
        state["optim"].step()
        ckpt.step(step, state)
    before = [local(p).clone() for p in state["model"].parameters()]
    if rank < 2:  # node 0 lost: its ranks come back fresh, with nothing of their own
        records.forget(ckpt._job)
        state = _hsdp_state(mesh, 5)
    ckpt = Checkpointer(f"{where}/ckpt", memory_dir=f"{where}/shm-{rank // 2}")
    restored = ckpt.restore(state)
    assert ckpt.last_restore is not None
    origins = [(o.kind, o.peer) for o in ckpt.last_restore.origins]
    after = [local(p) for p in state["model"].parameters()]
    same = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    ckpt.close()
    return restored, origins, same
