"""Which ranks hold the same replicated state as this one: the sources a replacement can
heal from (`unbroken.healing.live`).

Under DDP every rank holds the whole model and optimizer: any live rank is a source.
Under HSDP (FSDP2's ``fully_shard`` on a 2-D mesh, replicate x shard) or any other
DTensor state, a rank holds one shard, and the ranks holding the *same* shard are the
ones that share its coordinates on every mesh dimension that is not ``Replicate``: its
peers in the other replica groups. A DTensor sharded on every mesh dimension (pure FSDP)
has no such peer, and neither has a module whose parameters are plain tensors outside
DDP: healing is then impossible and the snapshot path restores.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from unbroken.healing.records import replicated
from unbroken.job.comm import Comm
from unbroken.state import Captured


def replicated_entries(state: Mapping[str, Any], live: Captured) -> Captured:
    """The captured entries data-parallel replicas share (modules, optimizers)."""
    return live.only([name for name, value in state.items() if replicated(value)])


def shard_peers(
    comm: Comm, state: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> list[int] | None:
    """The ranks of ``comm`` (this one included) whose replicated entries (``tensors``)
    hold the same local tensors as this rank's, by the DTensors' meshes and placements;
    None if they hold no DTensor (whole replicas: the caller decides by DDP). A module
    parameter that is a plain tensor, or a DTensor sharded on every dimension, leaves
    only this rank."""
    if not any(isinstance(t, DTensor) for t in tensors.values()):
        return None
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    if any(not isinstance(p, DTensor) for m in modules for p in m.parameters()):
        return [comm.rank]
    found: set[int] | None = None
    seen: set[tuple[int, tuple[Any, ...]]] = set()
    for t in tensors.values():
        if not isinstance(t, DTensor) or (id(t.device_mesh), t.placements) in seen:
            continue
        seen.add((id(t.device_mesh), t.placements))
        holders = {_group_rank(comm, g) for g in _same_shard(t)}
        found = holders if found is None else found & holders
    return sorted(found or {comm.rank})


def _same_shard(t: DTensor) -> list[int]:
    """Global ranks whose local part of ``t`` is this rank's: this rank's coordinate on
    every mesh dimension that is not `Replicate`, any coordinate on the others."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    index: list[Any] = [
        slice(None) if isinstance(p, Replicate) else coordinate[d]
        for d, p in enumerate(t.placements)
    ]
    ranks: torch.Tensor = mesh.mesh[tuple(index)]
    return [int(r) for r in ranks.reshape(-1).tolist()]


def _group_rank(comm: Comm, global_rank: int) -> int:
    if comm.group is None:
        return global_rank
    return int(dist.get_group_rank(comm.group, global_rank))


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local part (a view of its storage), else
    ``t``; detached."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()
