"""Tier 1 traffic: sending snapshots to the peers that keep replicas of them, and bringing
a lost rank's snapshot back from a peer at restore, straight into its tensors.

Both run on the checkpointer's own gloo group: every rank computes the same plan from the
same gathered table, then all point-to-point transfers of that plan go out in one batch
(no ordering between pairs to deadlock on). Replication copies one shared-memory slot
into another; at restore the bytes go block by block from the peer's slot into the lost
rank's live tensors, while the other ranks read their own memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from unbroken.errors import CheckpointError
from unbroken.format.layout import Chunk, Manifest
from unbroken.job.comm import Comm
from unbroken.job.transfers import Transfers
from unbroken.memory.tier import MemoryTier
from unbroken.run import faults


def replicate(comm: Comm, memory: MemoryTier, step: int, to: list[int], sources: list[int]) -> None:
    """Send this rank's snapshot of ``step`` to the ranks ``to``; receive the snapshots
    of ``sources`` into their replica slots. Returns once every rank holds its replicas:
    only then is ``step`` complete in memory."""
    text, data = memory.own.raw(step)
    header = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    sizes = comm.all_gather([header.numel(), data.numel()])
    ops, arriving = [], []
    for peer in to:
        ops += [comm.p2p(dist.isend, header, peer), comm.p2p(dist.isend, data, peer)]

    def make_room() -> None:  # a rank that has none fails them all: nobody waits to send
        for owner in sources:
            slots = memory.replica(owner)
            try:
                slot, buffer = slots.begin(sizes[owner][1])
            except OSError as e:
                raise CheckpointError(
                    f"{slots.dir}: no room for rank {owner}'s replica of step {step} "
                    f"({sizes[owner][1]} bytes): {e.strerror or e}; give the shared-memory "
                    "file system more room (docker --shm-size, a larger /dev/shm)"
                ) from e
            arriving.append((slots, slot, torch.empty(sizes[owner][0], dtype=torch.uint8)))
            ops.extend(comm.p2p(dist.irecv, t, owner) for t in (arriving[-1][2], buffer))

    try:
        comm.together(f"making room for the replicas of step {step}", make_room)
        with comm.wire():  # a transfer that lost its peer ends the group's use
            comm.start(ops).wait()
        faults.point("replica-transfer")
        for slots, slot, got_header in arriving:
            slots.publish(slot, got_header.numpy().tobytes().decode())
        faults.point("replica-published")
    finally:
        for slots, slot, _ in arriving:
            slots.release(slot)
    comm.together(f"replicating step {step}", lambda: None)


def manifests(comm: Comm, memory: MemoryTier, step: int, plan: dict[int, int]) -> str | None:
    """``plan`` maps each rank whose own copy of ``step`` is gone to the rank that holds
    its replica. Every provider publishes the replicas' manifests; returns this rank's
    (JSON), if it is one of the lost. Collective."""

    def offer() -> dict[str, str]:
        return {
            str(lost): memory.holding(lost, step).raw(step)[0]
            for lost, provider in plan.items()
            if provider == comm.rank
        }

    # Together: a provider that lacks the step fails every rank, rather than leaving
    # the others waiting for its manifest.
    published = comm.gathered(f"sharing the replicas' manifests of step {step}", offer)
    if comm.rank not in plan:
        return None
    text: str = published[plan[comm.rank]][str(comm.rank)]
    return text


def send(comm: Comm, memory: MemoryTier, step: int, plan: dict[int, int]) -> Transfers:
    """Start sending, block by block, the replicas this rank provides under ``plan``."""
    ops = []
    for lost, provider in sorted(plan.items()):
        if provider == comm.rank:
            slots = memory.holding(lost, step)
            text, data = slots.raw(step)
            for _, chunk in blocks(Manifest.from_json(text.encode(), slots.dir)):
                ops.append(comm.p2p(dist.isend, data[chunk.start : chunk.end], lost))
    return comm.start(ops)


def receive(
    comm: Comm, manifest: Manifest, provider: int, into: dict[str, torch.Tensor]
) -> Transfers:
    """Start receiving this rank's replica from ``provider``, block by block, straight
    into ``into[key]`` (a byte tensor of the block's size), or a scratch buffer for the
    blocks nobody wants."""
    ops = []
    for key, chunk in blocks(manifest):
        target = into.get(key)
        if target is None:
            target = torch.empty(chunk.nbytes, dtype=torch.uint8)
        ops.append(comm.p2p(dist.irecv, target, provider))
    return comm.start(ops)


def blocks(manifest: Manifest) -> list[tuple[str, Chunk]]:
    """The blocks of a snapshot, in the order both ends of a transfer use."""
    found = [(key, entry.chunks[0]) for key, entry in manifest.tensors.items()]
    return sorted(((k, c) for k, c in found if c.nbytes), key=lambda kc: kc[1].start)
