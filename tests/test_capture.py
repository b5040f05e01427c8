"""A restore walks the live state once: every stage (the heal plan, the replicas' checks,
the transfers and loading; or checking, reading and applying a stored step) takes the
state's tensors from one captured value, so each Stateful's ``state_dict()`` runs once
per restore, whichever way the restore goes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ranks import run_ranks
from unbroken import Checkpointer, Progress
from unbroken.state import capture

pytestmark = pytest.mark.timeout(120)
TWO_RANK = True  # tests/test_stress.py runs this file under CPU load


def test_a_restore_walks_the_state_once_healing_from_a_replica_or_reading_storage(tmp_path):
    # Per rank: [(origin, model walks, optimizer walks, equal to rank 0's model)] for a
    # heal from rank 0's live replica, then for an explicit step read from storage.
    assert run_ranks(_restore_job, str(tmp_path), timeout=100) == [
        [("live", 1, 1, True), ("storage", 1, 1, True)],
        [("live", 1, 1, True), ("storage", 1, 1, True)],
    ]


def _restore_job(rank: int, world: int, path: str) -> list[tuple[str, int, int, bool]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from unbroken.healing import records

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    state: dict[str, Any] = {"model": model, "optim": optim, "progress": Progress(step=0)}
    ckpt = Checkpointer(path)
    for step in (1, 2):
        optim.zero_grad()
        model(torch.full((2, 8), float(step))).pow(2).sum().backward()
        optim.step()
        state["progress"].step = step
        ckpt.step(step, state)
    ckpt.save(2, state)
    walks = {"model": 0, "optim": 0}
    for name in walks:
        walks_of(state[name], name, walks)
    results: list[tuple[str, int, int, bool]] = []
    for wanted in (None, 2):
        if rank == 1:  # a replacement: no records, and state that differs from the live one
            records.forget(ckpt._job)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
        walks.update(model=0, optim=0)
        assert ckpt.restore(state, wanted) == 2
        assert ckpt.last_restore is not None
        origin = ckpt.last_restore.origins[rank].kind
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        theirs = mine.clone()
        dist.broadcast(theirs, 0)
        results.append((origin, walks["model"], walks["optim"], torch.equal(mine, theirs)))
    ckpt.close()
    return results


def walks_of(stateful: Any, name: str, walks: dict[str, int]) -> None:
    """Count the full walks of ``stateful``: ``state_dict()`` as `capture` calls it, not
    the fingerprint's ``keep_vars=True`` view of a module's tensors."""
    original = stateful.state_dict

    def counted(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("keep_vars"):
            walks[name] += 1
        return original(*args, **kwargs)

    stateful.state_dict = counted


def test_captured_entries_are_taken_apart_and_walked_again_by_name():
    a, b = torch.zeros(3), torch.ones(2)
    state = {"a": {"w": a, "n": 1}, "b": b, "ab": {"x": [a]}}
    live = capture(state)
    assert set(live.only(["a"]).tensors) == {"a/w"} and set(live.only(["a"]).tree) == {"a"}
    assert set(live.only(["ab", "b"]).tensors) == {"ab/x/0", "b"}
    state["a"] = {"w": torch.full((3,), 7.0), "m": b}
    again = live.refreshed(state, ["a"])
    assert set(again.tensors) == {"a/w", "a/m", "b", "ab/x/0"}
    assert torch.equal(again.tensors["a/w"], torch.full((3,), 7.0))
    assert again.tensors["b"] is b and again.tree["a"]["m"] == {"__tensor__": "a/m"}
    assert live.refreshed(state, []) is live
