"""Tier 1 traffic: sending snapshots to the peers that keep replicas of them, and bringing
a lost rank's snapshot back from a peer at restore.

Both are collective on the checkpointer's own gloo group: every rank computes the same
plan from the same gathered table, then all point-to-point transfers of that plan go out
in one batch (no ordering between pairs to deadlock on). Bytes travel straight from one
shared-memory slot into another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from unbroken.dist import Comm
from unbroken.memory import MemoryTier, Slots


def replicate(comm: Comm, memory: MemoryTier, step: int, to: list[int], sources: list[int]) -> None:
    """Send this rank's snapshot of ``step`` to the ranks ``to``; receive the snapshots
    of ``sources`` into their replica slots. Returns once every rank holds its replicas:
    only then is ``step`` complete in memory."""
    text, data = memory.own.raw(step)
    header = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    sizes = comm.all_gather([header.numel(), data.numel()])
    ops, arriving = [], []
    for peer in to:
        ops += [_op(dist.isend, header, peer, comm), _op(dist.isend, data, peer, comm)]
    for owner in sources:
        slots = memory.replica(owner)
        got_header = torch.empty(sizes[owner][0], dtype=torch.uint8)
        slot, buffer = slots.begin(sizes[owner][1])
        ops += [_op(dist.irecv, got_header, owner, comm), _op(dist.irecv, buffer, owner, comm)]
        arriving.append((slots, slot, got_header))
    _run(ops)
    for slots, slot, got_header in arriving:
        slots.publish(slot, got_header.numpy().tobytes().decode())
    comm.together(f"replicating step {step}", lambda: None)


def recover(comm: Comm, memory: MemoryTier, step: int, holders: dict[int, list[int]]) -> None:
    """Bring ``step`` back to every rank whose own copy is gone, from the lowest rank in
    ``holders[r]`` (the ranks holding a replica of rank r at ``step``)."""
    plan = {r: min(q) for r, q in sorted(holders.items())}  # lost rank -> provider
    offers = {}
    for lost, provider in plan.items():
        if provider == comm.rank:
            text, data = memory.replica(lost).raw(step)
            offers[lost] = (torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8), data)
    sizes = comm.all_gather({str(r): [h.numel(), d.numel()] for r, (h, d) in offers.items()})
    ops = []
    for lost, (header, data) in offers.items():
        ops += [_op(dist.isend, header, lost, comm), _op(dist.isend, data, lost, comm)]
    arriving: tuple[Slots, int, torch.Tensor] | None = None
    if comm.rank in plan:
        provider = plan[comm.rank]
        n_header, n_data = sizes[provider][str(comm.rank)]
        got_header = torch.empty(n_header, dtype=torch.uint8)
        slot, buffer = memory.own.begin(n_data)
        ops += [
            _op(dist.irecv, got_header, provider, comm),
            _op(dist.irecv, buffer, provider, comm),
        ]
        arriving = (memory.own, slot, got_header)
    _run(ops)
    if arriving is not None:
        slots, slot, got_header = arriving
        slots.publish(slot, got_header.numpy().tobytes().decode())
    comm.together(f"recovering step {step} from replicas", lambda: None)


def _op(kind: object, tensor: torch.Tensor, peer: int, comm: Comm) -> dist.P2POp:
    return dist.P2POp(kind, tensor, group=comm.group, group_peer=peer)  # type: ignore[arg-type]


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
