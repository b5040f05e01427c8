"""The restore pipeline, in named stages: choose the step and this rank's source of it
(`unbroken.restoring.step_choice`), check, read, share, apply.

Keys and shapes are checked on every rank before anything is read, and the files' sizes
beside the reads (one round trip fewer on an object store), so bad input costs nothing:
a failure of either puts back what a read overwrote (a host copy taken before reading,
or none where the source holds what it read until every rank has checked its part), then
falls back to the next newest copy that verifies, or raises.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from unbroken import sdc
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import Manifest
from unbroken.format.shards import dtensor_offsets, overlap
from unbroken.format.validate import stored_enough
from unbroken.job.comm import Comm
from unbroken.memory.tier import MemoryTier
from unbroken.restoring import reading
from unbroken.restoring.backup import Backup
from unbroken.restoring.reading import Target
from unbroken.restoring.reshard import saved_objects
from unbroken.restoring.sources import Origin, Restored
from unbroken.restoring.step_choice import Choice, choose, fell_back
from unbroken.state import Captured, init_state, is_stateful
from unbroken.tree import decode, prune, tensor_keys

__all__ = ["Origin", "RestoreContext", "Restored", "restore"]


@dataclass(frozen=True, kw_only=True)
class RestoreContext:
    """What a restore needs: the checkpointer's group, the directory, reader threads
    per rank, how ranks share tensors they all need whole (``replicated_reads``), and
    the memory tier with the ranks whose snapshots this rank keeps replicas of."""

    comm: Comm
    directory: Directory
    io_threads: int
    replicated_reads: Literal["each", "broadcast", "slice"]
    memory: MemoryTier | None = None
    replica_sources: tuple[int, ...] = ()


def restore(
    ctx: RestoreContext,
    state: MutableMapping[str, Any],
    live: Captured,
    step: int | None,
    strict: bool,
    fallback: bool = True,
) -> Restored | None:
    """Load ``step`` (None: the newest) into ``state``, captured once as ``live``; None if
    there is nothing to restore. Collective. A copy found damaged (checksum, truncated
    or missing file) is passed over for the next newest copy that verifies, in memory or
    on storage, when ``step`` is None and ``fallback``; otherwise the error is raised.
    Either way a failed attempt leaves ``state`` as it was (see `Backup`)."""
    rejected: set[tuple[str, int]] = set()
    damage: list[str] = []
    while True:
        choice = choose(ctx.comm, ctx.directory, ctx.memory, ctx.replica_sources, step, rejected)
        if choice is None:
            if damage:
                raise CorruptCheckpointError(
                    f"{ctx.directory.path}: no checkpoint verifies; {'; '.join(damage)}. "
                    "`unbroken verify --all` lists what is damaged"
                )
            return None
        # The suspect mark lives on storage, beside the manifest, whichever tier the
        # step comes from: a snapshot of a step saved as suspect is as suspect.
        said = sdc.restoring(ctx.directory.storage, choice.step) if ctx.comm.rank == 0 else None
        try:
            restored = _load(ctx, state, live, choice, strict)
        except Exception as e:  # on every rank: each stage fails everywhere or nowhere
            if not _damaged(ctx.comm, e) or step is not None or not fallback:
                raise
            tier = "storage" if choice.from_storage else "memory"
            rejected.add((tier, choice.step))
            damage.append(f"step {choice.step} ({tier}): {e}")
            fell_back(choice.step, tier, f"step {choice.step} is damaged: {e}")
            continue
        if said is not None:
            said()  # rank 0 alone, after the last collective: it never raises
        damaged = tuple(Origin(kind, s) for kind, s in sorted(rejected))  # type: ignore[arg-type]
        return replace(restored, damaged=damaged)


def _damaged(comm: Comm, error: BaseException) -> bool:
    """Whether a failed load met damage on some rank (the others only hear that it
    failed). Collective: every rank of a failed stage calls it."""
    return any(comm.all_gather(isinstance(error, CorruptCheckpointError)))


def _load(
    ctx: RestoreContext,
    state: MutableMapping[str, Any],
    live: Captured,
    choice: Choice,
    strict: bool,
) -> Restored:
    """Load ``choice`` into ``state``: all of it, or (raising) nothing."""
    comm = ctx.comm
    # Fresh optimizers of sharded parameters get their state tensors first (`init_state`):
    # only those entries are walked again.
    fresh = [n for n, o in state.items() if isinstance(o, Optimizer) and init_state(o)]
    live = live.refreshed(state, fresh)
    backup: Backup | None = None
    try:
        manifest, tree, targets = comm.together(
            f"checking step {choice.step}", lambda: _check(comm, choice, state, live, strict)
        )
        # Memory is read where it is: a rank's snapshot holds its own values, per-rank
        # ones too, so nothing is broadcast from another rank's copy.
        readers = (
            reading.readers(comm, targets, ctx.replicated_reads) if choice.from_storage else {}
        )
        reads = reading.plan(comm, targets, readers)
        held = {reading.memory(f.region) for f in reads.fills if choice.source.holds(f)}
        backup = Backup(
            t.region
            for t in targets
            if t.dest is not None and t.region is not None and reading.memory(t.region) not in held
        )
        files = {c.file for t in targets for c in t.chunks}
        place = comm.together(
            f"reading step {choice.step}",
            lambda: reading.read(
                comm, ctx.memory, choice, manifest, files, reads.fills, ctx.io_threads
            ),
        )
        if readers:
            reading.share(comm, choice, manifest, readers, reads)
    except BaseException:
        if backup is not None:
            backup.put_back()
        for name in fresh:
            state[name].state.clear()  # as it was: nothing changes when a restore fails
        raise
    if place is not None:
        place()  # every rank has read and checked its part: nothing is left to fail
    comm.together(
        f"loading step {choice.step} into the state",
        lambda: _apply(state, tree, reads.loaded, strict),
    )
    return Restored(step=choice.step, origins=choice.origins, rank=comm.rank)


# -- check ---------------------------------------------------------------------------


def _check(
    comm: Comm, choice: Choice, state: Mapping[str, Any], live: Captured, strict: bool
) -> tuple[Manifest, dict[str, Any], list[Target]]:
    """Check the keys and shapes a restore will touch, and list what it reads."""
    source = choice.source
    manifest = source.open()
    # Saved by another number of ranks: tensors are resharded by region, per-rank state
    # follows the rule of `unbroken.restoring.reshard`.
    saved, kept = saved_objects(source.where, manifest, state, comm.rank, comm.world_size)
    entries = {name: value for name, value in state.items() if name not in kept}
    current = live.only(entries).tensors
    tree = _select(source.where, saved, entries, current, strict)
    return manifest, tree, _targets(source.where, manifest, tree, current, comm.rank)


def _select(
    where: str,
    saved: dict[str, Any],
    state: Mapping[str, Any],
    current: dict[str, torch.Tensor],
    strict: bool,
) -> dict[str, Any]:
    """The saved trees of the entries both sides have, less the module tensors only the
    checkpoint has (``strict`` refuses any difference instead)."""
    names = saved.keys() & state.keys()
    if strict:
        _mismatch(where, "state entry", state.keys() - saved.keys(), saved.keys() - names)
    tree = {}
    for name in names:
        _same_workers(name, state[name], saved[name])  # before anything is read
        keys = set(tensor_keys(saved[name]))
        if isinstance(state[name], nn.Module):
            here = {k for k in current if k.startswith(f"{name}/")}
            if strict:
                _mismatch(where, f"tensor of {name!r}", here - keys, keys - here)
            keys &= here
        tree[name] = prune(saved[name], keys)
    return tree


def _targets(
    where: str,
    manifest: Manifest,
    tree: dict[str, Any],
    current: dict[str, torch.Tensor],
    rank: int,
) -> list[Target]:
    targets = []
    for name in tree:
        for key in tensor_keys(tree[name]):
            entry = manifest.tensors.get(key)
            if entry is None:
                raise CheckpointError(f"{where}: the manifest lists no tensor {key!r}")
            dest = current.get(key)
            if dest is None:  # not live: allocated from the manifest, so bounded first
                stored_enough(key, entry.dtype, entry.shape, entry.chunks, where)
            region, offsets = dest, [0] * len(entry.shape)
            if isinstance(dest, DTensor):
                region, offsets = dest.to_local(), list(dtensor_offsets(dest))
            if dest is not None and list(dest.shape) != entry.shape:
                raise CheckpointError(
                    f"{where}: tensor {key!r} has shape {entry.shape} in the checkpoint "
                    f"but {list(dest.shape)} in the state; build the model with the "
                    "configuration it was saved with"
                )
            # Only the chunks overlapping this rank's part: the others are never opened.
            shape = entry.shape if region is None else list(region.shape)
            chunks = [
                c
                for c in entry.chunks
                if (c.ranks is None or rank in c.ranks)
                and (not shape or overlap(offsets, shape, c.offsets, c.shape) is not None)
            ]
            if not _covered(offsets, shape, chunks):
                raise CorruptCheckpointError(
                    f"{where}: tensor {key!r}: its stored blocks cover only part of what "
                    f"rank {rank} holds of it; the manifest is damaged or not trusted"
                )
            targets.append(Target(key, entry, dest, region, offsets, chunks))
    return targets


def _covered(offsets: list[int], shape: list[int], chunks: list[Any]) -> bool:
    """Whether ``chunks`` fill the region at ``offsets`` of ``shape`` (blocks do not
    overlap: `unbroken.format.validate`). A snapshot's manifest holds one rank's blocks,
    so its validation cannot ask that they cover the whole tensor; this rank's part
    must be covered all the same."""
    volume = 0
    for c in chunks:
        region = overlap(offsets, shape, c.offsets, c.shape)
        volume += 0 if region is None else math.prod(hi - lo for lo, hi in region)
    return volume >= math.prod(shape)


# -- apply ---------------------------------------------------------------------------


def _apply(
    state: MutableMapping[str, Any],
    tree: dict[str, Any],
    loaded: dict[str, torch.Tensor],
    strict: bool,
) -> None:
    """Hand each Stateful its state and replace plain values; tensors are in place."""
    for name, encoded in tree.items():
        value = decode(encoded, loaded)
        target = state[name]
        if isinstance(target, nn.Module):
            target.load_state_dict(value, strict=strict)
        elif is_stateful(target):
            target.load_state_dict(value)
        elif not isinstance(target, torch.Tensor):
            state[name] = value


def _same_workers(name: str, target: Any, value: Any) -> None:
    """torchdata's StatefulDataLoader takes a state saved with another ``num_workers``
    and fails only at its first batch, with a bare AssertionError: refuse it here."""
    if not type(target).__module__.startswith("torchdata") or not isinstance(value, dict):
        return
    if "_snapshot" in value:
        saved = value["_snapshot"].get("_main_snapshot", {}).get("_num_workers")
    else:
        saved = 0 if "_num_yielded" in value else None
    live = getattr(target, "num_workers", None)
    if saved is not None and live is not None and saved != live:
        raise CheckpointError(
            f"state {name!r}: the checkpoint's StatefulDataLoader ran with num_workers="
            f"{saved}, this one has num_workers={live}; torchdata resumes a position only "
            f"with as many workers: build the loader with num_workers={saved} to resume "
            f"exactly, or leave {name!r} out of the restore to start its epoch afresh"
        )


def _mismatch(where: str, what: str, missing: set[str], unexpected: set[str]) -> None:
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {sorted(missing)[:10]}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the state: {sorted(unexpected)[:10]}")
    if problems:
        raise CheckpointError(
            f"{where}: {what} keys differ ({'; '.join(problems)}); pass strict=False to "
            "restore only the keys both have"
        )
