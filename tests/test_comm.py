"""The checkpointer's group: its operations return only once gloo has let go of their
tensors, so that no gloo thread frees a Python object afterwards (a fork at that instant
leaves the child hung on CPython before 3.11.10; `unbroken.job.comm` says why)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from ranks import run_ranks

TWO_RANK = True  # tests/test_stress.py runs this file under CPU load
ROUNDS = 60  # without the wait, gloo still held a tensor after ~1 in 3 operations


def _held_after_each_operation(rank: int, world: int) -> dict[str, int]:
    import torch.distributed as dist

    from unbroken.job.comm import Comm

    comm = Comm(None, timedelta(seconds=30))
    handed: list[torch.Tensor] = []

    def recording(name: str) -> None:  # the real operation, noting the tensors it gets
        real = getattr(dist, name)

        def op(*args: Any, **kwargs: Any) -> Any:
            for a in args:
                items = a if isinstance(a, list) else [a]
                handed.extend(t for t in items if isinstance(t, torch.Tensor))
                handed.extend(o.tensor for o in items if isinstance(o, dist.P2POp))
            return real(*args, **kwargs)

        setattr(dist, name, op)

    for name in ("all_gather", "broadcast", "all_reduce", "batch_isend_irecv", "gather", "scatter"):
        recording(name)
    peer = 1 - rank
    operations = {
        "all_gather": lambda i: comm.all_gather({"round": i, "rank": rank}),
        "gathered": lambda i: comm.gathered("a step", lambda: i),
        "broadcast": lambda i: comm.broadcast(list(range(i))),
        "planned": lambda i: comm.planned("a plan", lambda: i, lambda rows: rows[::-1]),
        "broadcast_bytes": lambda i: comm.broadcast_bytes(memoryview(bytearray(64)), 0),
        "all_reduce_max": lambda i: comm.all_reduce_max(torch.tensor([rank, i])),
        "transfers": lambda i: comm.start(
            [
                comm.p2p(dist.isend, torch.full((256,), rank, dtype=torch.uint8), peer),
                comm.p2p(dist.irecv, torch.empty(256, dtype=torch.uint8), peer),
            ]
        ).wait(),
    }
    held = dict.fromkeys(operations, 0)
    for what, operation in operations.items():
        for i in range(ROUNDS):
            handed.clear()
            operation(i)
            assert handed, f"{what} handed gloo no tensor"
            held[what] += any(t._use_count() > 1 for t in handed)  # type: ignore[attr-defined]
    comm.close()
    return held


@pytest.mark.timeout(120)
def test_every_operation_returns_after_gloo_let_go_of_its_tensors() -> None:
    for rank, held in enumerate(run_ranks(_held_after_each_operation)):
        assert held == dict.fromkeys(held, 0), f"rank {rank}: gloo still held tensors: {held}"
