"""The first stage of a restore: the step every rank agrees on, and where each rank's
bytes of it come from.

Shared memory wins when every rank can get the step from it (its own snapshot, or a
peer's replica for a rank whose copy is gone) and it is at least as new as the newest
step on storage. Only the copies to be used are checksummed, once, here: a damaged one
makes every rank pass the step over and choose again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.directory import Directory
from unbroken.job.comm import Comm
from unbroken.memory import replicas
from unbroken.memory.tier import MemoryTier
from unbroken.restoring.sources import MemorySource, Origin, ReplicaSource, Source, StorageSource
from unbroken.run import worker

log = logging.getLogger("unbroken")


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The step to restore and this rank's `Source` of it. ``serves`` maps each rank
    whose bytes come from a peer's replica to that peer (empty from storage); every
    provider sends while the others read."""

    step: int
    source: Source
    origins: tuple[Origin, ...]  # every rank's, in rank order
    serves: dict[int, int] = field(default_factory=dict)

    @property
    def from_storage(self) -> bool:
        return all(o.kind == "storage" for o in self.origins)


def choose(
    comm: Comm,
    directory: Directory,
    memory: MemoryTier | None,
    replica_sources: Sequence[int],
    step: int | None,
    rejected: set[tuple[str, int]] | None = None,
) -> Choice | None:
    """Agree on the step (``step``, or the newest; None if there is none) and on its
    sources. Collective; raises on every rank if ``step`` is committed nowhere.
    ``rejected`` holds the ``(tier, step)`` pairs a restore found damaged (tier
    ``"memory"`` or ``"storage"``): they are passed over, and a step damaged in memory
    here is added. ``replica_sources`` is no longer needed (every copy in memory is found
    by the rank that saved it) and is ignored."""
    del replica_sources
    rejected = set() if rejected is None else rejected
    bad_memory = {s for tier, s in rejected if tier == "memory"}
    bad_storage = {s for tier, s in rejected if tier == "storage"}
    while True:
        in_memory = _in_memory(comm, memory, bad_memory, step)

        read: list[bytes] = []  # rank 0's: the manifest, if it comes from storage

        def pick(
            in_memory: dict[int, dict[int, list[int]]] = in_memory, read: list[bytes] = read
        ) -> list[Any]:
            if comm.rank:
                return []
            chosen, data, damage = _on_rank_0(directory, step, in_memory, bad_storage)
            read.extend([] if data is None else [data])
            return [chosen, None if data is None else len(data), damage]

        chosen, size, damage = comm.broadcast(comm.together("finding a checkpoint", pick))
        if chosen is None:
            return None
        if chosen not in in_memory:
            origins = (Origin("storage", chosen),) * comm.world_size
            source = StorageSource(directory, chosen, damage=damage)
            if size is not None:  # its bytes, as they are, to every rank; checked in parts
                data = bytearray(read[0] if read else size)
                comm.broadcast_bytes(memoryview(data), 0)
                source.validate(comm, bytes(data))
            return Choice(step=chosen, source=source, origins=origins)
        assert memory is not None
        choice = _from_memory(comm, memory, chosen, in_memory[chosen])
        if choice is not None:
            return choice
        bad_memory.add(chosen)
        rejected.add(("memory", chosen))
        fell_back(chosen, "memory", f"step {chosen} in shared memory is damaged")


def fell_back(step: int, tier: str, reason: str) -> None:
    """Say loudly that ``step`` in ``tier`` is damaged and an older copy is tried, and
    record the event for `unbroken run`'s timeline."""
    log.error("restore: %s (falling back to the newest older copy that verifies)", reason)
    worker.event("fallback", step=step, tier=tier, reason=reason[:500])


def _on_rank_0(
    directory: Directory, step: int | None, in_memory: Mapping[int, object], bad: set[int]
) -> Found:
    """The step, the manifest's bytes if they come from storage (one request for the
    job), and why they could not be read if the manifest is damaged (see
    `_with_manifest`). The step the ``latest`` pointer names is not checked first:
    reading its manifest checks it, a request sooner."""
    chosen = _pick(directory, step, in_memory, bad, directory.pointed)
    try:
        return _with_manifest(directory, chosen, in_memory)
    except CheckpointError:
        if step is not None:
            raise
    # The pointer names a step that is gone: the listing says which is the newest.
    return _with_manifest(
        directory, _pick(directory, step, in_memory, bad, directory.latest), in_memory
    )


Found = tuple[int | None, bytes | None, str | None]  # step, its manifest, its damage


def _with_manifest(
    directory: Directory, chosen: int | None, in_memory: Mapping[int, object]
) -> Found:
    """``(step, manifest bytes or None, damage or None)``. A manifest that is there but
    cannot be read (a link, a folder: `CorruptCheckpointError`) is damage like a
    manifest that does not parse: every rank's source fails to open with it, and the
    restore passes the step over, naming it, or raises where it may not fall back."""
    if chosen is None or chosen in in_memory:
        return chosen, None, None
    try:
        return chosen, directory.manifest_bytes(chosen), None
    except CorruptCheckpointError as e:
        return chosen, None, str(e)


def _pick(
    directory: Directory, step: int | None, in_memory: Mapping[int, object], bad: set[int],
    newest_stored: Callable[[], int | None],
) -> int | None:  # fmt: skip
    """On rank 0: ``step`` if given (it must be in memory or committed), else the newest
    step in memory or on storage (``newest_stored``), memory winning a tie. Steps in
    ``bad`` are damaged on storage: the next older committed one is taken (a listing, on
    this rare path)."""
    if step is not None:
        return None if step in bad else step  # not committed: reading its manifest says so
    stored = newest_stored()
    if stored in bad:
        stored = max((s for s in directory.steps() if s not in bad), default=None)
    newest = max(in_memory, default=None)
    if newest is not None and (stored is None or newest >= stored):
        return newest
    return stored


def _from_memory(
    comm: Comm, memory: MemoryTier, step: int, holders: dict[int, list[int]]
) -> Choice | None:
    """Sources in memory for ``step``, or None (on every rank) if a copy to be used is
    damaged somewhere. ``holders`` maps each rank whose own copy is gone to the ranks
    holding a copy of it; the one serving fewest so far provides it (the ranks of a
    node all see its memory: spread the sending over them)."""
    plan: dict[int, int] = {}  # lost -> provider: the holder serving fewest so far
    for lost, candidates in sorted(holders.items()):
        plan[lost] = min(candidates, key=lambda q: (list(plan.values()).count(q), q))
    ok = all(
        memory.holding(r, step).intact(step) is not None for r, p in plan.items() if p == comm.rank
    )
    own = None
    if comm.rank not in plan:
        # Its own folder, or another one on this node holding what this rank saved.
        own = MemorySource(memory.holding(comm.rank, step), step)
        try:
            own.open()  # checksums every block, once
        except CheckpointError as e:
            log.warning("ignoring %s", e)
            ok = False
    intact = comm.all_gather(ok)
    if not all(intact):
        bad = [r for r, good in enumerate(intact) if not good]
        log.warning("step %d in shared memory is damaged on ranks %s; not using it", step, bad)
        return None
    text = replicas.manifests(comm, memory, step, plan) if plan else None
    source: Source
    if own is not None:
        source = own
    else:  # this rank's copy is gone: its bytes come from plan[rank], not storage
        assert text is not None
        source = ReplicaSource(comm, plan[comm.rank], step, text)
    if plan:
        log.info("step %d recovered from peer replicas for ranks %s", step, sorted(plan))
    log.info("restoring step %d from shared memory", step)
    origins = tuple(
        Origin("replica", step, plan[r]) if r in plan else Origin("memory", step)
        for r in range(comm.world_size)
    )
    return Choice(step=step, source=source, origins=origins, serves=plan)


def _in_memory(
    comm: Comm, memory: MemoryTier | None, rejected: set[int], step: int | None
) -> dict[int, dict[int, list[int]]]:
    """The steps every rank can get from shared memory: from its node's memory, or, for
    a rank whose copy is gone, from a peer that holds one. Copies are found by the rank
    that saved them, in any folder of any node (ranks renumbered by a restart find
    theirs where they are). ``{step: {lost rank: holders}}``. Collective; the same
    exchange checks that every rank asked for the same ``step``."""
    own: list[int] = []
    kept: dict[str, list[int]] = {}
    if memory is not None:
        held = memory.steps_of()
        own = held.pop(comm.rank, [])
        kept = {str(o): steps for o, steps in held.items()}
    rows = comm.all_gather([step, own, kept])
    if len({requested for requested, _, _ in rows}) > 1:
        raise CheckpointError(
            f"ranks disagree on the step to restore: {dict(enumerate(r[0] for r in rows))}; "
            "every rank must call restore() with the same step"
        )
    table = [(own, kept) for _, own, kept in rows]
    found = {}
    for candidate in {s for steps, _ in table for s in steps} | {
        s for _, k in table for steps in k.values() for s in steps
    }:
        if candidate in rejected:
            continue
        lost = {r for r, (steps, _) in enumerate(table) if candidate not in steps}
        holders = {
            r: [q for q, (_, k) in enumerate(table) if candidate in k.get(str(r), [])] for r in lost
        }
        if all(holders.values()):
            found[candidate] = holders
    return found
