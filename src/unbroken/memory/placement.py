"""Where a Checkpointer's copies go besides storage: this node's shared-memory tier, the
peers that keep replicas of this rank's snapshots, and the peer that holds its per-step
records."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from unbroken.job.comm import Comm
from unbroken.memory.partners import replica_layout
from unbroken.memory.tier import MemoryTier
from unbroken.run import contract


@dataclass(frozen=True)
class Placement:
    memory: MemoryTier | None
    partners: list[int]  # ranks that keep replicas of this rank
    sources: list[int]  # ranks this rank keeps replicas of
    records: tuple[list[int], list[int]]  # (to, from) for `Checkpointer.step` records


def place(comm: Comm, job: str, memory: bool, memory_dir: str | None, replicas: int) -> Placement:
    """Collective: every rank's node is gathered (what torchrun calls one, its node rank,
    or a simulated one). Per-step records go to one rank on another node: the replica
    partners where there are any."""
    node = os.environ.get(contract.NODE_ENV) or os.environ.get("GROUP_RANK")
    nodes = list(comm.all_gather(f"{socket.gethostname()}/{node}"))
    tier, partners, sources = None, list[int](), list[int]()
    if memory:
        root = memory_dir or os.environ.get(contract.MEMORY_DIR_ENV) or contract.DEFAULT_MEMORY_ROOT
        tier = MemoryTier(root, job, comm.rank, comm.world_size)
        if replicas:
            partners, sources = replica_layout(nodes, comm.rank, replicas)
    to, came = partners, sources
    if not to and not came:
        to, came = replica_layout(nodes, comm.rank, 1)
    return Placement(tier, partners, sources, (to, came))
