# mypy: disallow-untyped-defs
"""The scale harness's per-rank phases (bench/scale.py): step agreement, heal plan, save
plan, manifest validation. Each runs unbroken's own code on one rank, rank 0 (the busiest:
it also picks the step and encodes the manifest), with every other rank's part of each
exchange made up front, untimed, as those ranks would send it.

What is real: `unbroken.restoring.step_choice._in_memory` (the step every rank can get
from shared memory, and who holds each lost rank's copy), `unbroken.healing.live.plan`
with `unbroken.healing.messages` checking the gathered rows and digests,
`unbroken.saving.checksums.shared` + `unbroken.format.write_plan.make_plan` and the
manifest's encoding (bench/metadata.py's `unbroken_save`, as `unbroken.saving.pipeline`
does between its collectives), `unbroken.format.layout.Manifest.from_json`, which
validates (`unbroken.format.validate`) before anything is used. `Gathered` stands in for
`unbroken.job.comm.Comm`: its ``all_gather`` does the JSON work `Comm.all_gather` does on
a rank (its own row encoded, every row decoded, the collector paused), and moves no
bytes. So the times are CPU on the critical path of a rank; the transport (a gloo ring
of ``n - 1`` sequential steps per all_gather, on a group already connected: no store
request) is not in them: it is counted as ``ring_steps``.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from metadata import rows_of, unbroken_save
from unbroken.format.layout import Manifest
from unbroken.healing import live, messages
from unbroken.job import gc_paused
from unbroken.restoring import step_choice

STEP = 1000  # the step every live rank is at, and the newest snapshot in memory
LOCAL = 8  # ranks per node
LOST_NODE = 1  # the node whose ranks are replacements


class Gathered:
    """`Comm` as rank 0 of ``world`` sees it: each ``all_gather`` returns the next table
    of rows, its own row replaced by what it passes, with `Comm.all_gather`'s JSON work.
    ``broadcast`` returns what rank 0 passes, encoded and decoded once."""

    rank = 0

    def __init__(self, world: int, tables: Iterator[list[bytes]]) -> None:
        self.world_size = world
        self._tables = tables
        self.exchanges = 0

    def all_gather(self, obj: Any) -> list[Any]:
        self.exchanges += 1
        wire = next(self._tables)
        wire[0] = json.dumps(obj).encode()
        with gc_paused.building():
            return [json.loads(w) for w in wire]

    def broadcast(self, obj: Any) -> Any:
        self.exchanges += 1
        return json.loads(json.dumps(obj).encode())

    def together(self, what: str, fn: Callable[[], Any]) -> Any:
        result = fn()
        self.all_gather([None, None])
        return result


def lost(rank: int) -> bool:
    return rank // LOCAL == LOST_NODE


def partner(rank: int, world: int) -> int:
    """Whose replica ``rank`` keeps: the same local rank on the previous node."""
    return (rank - LOCAL) % world


def _encoded(rows: list[Any]) -> list[bytes]:
    return [json.dumps(r).encode() for r in rows]


class _Memory:
    """What `MemoryTier.steps_of` answers on rank 0: its own snapshot and its partner's."""

    def __init__(self, world: int) -> None:
        self.world = world

    def steps_of(self) -> dict[int, list[int]]:
        return {0: [STEP], partner(0, self.world): [STEP]}


def step_agreement(world: int) -> tuple[float, int]:
    """`_in_memory` (every rank's snapshots and the replicas it keeps), then the
    exchanges `choose` adds: `together` (rank 0 picks), the broadcast of its pick, and
    `_from_memory`'s vote on the copies to use. (seconds, exchanges)."""
    rows: list[list[Any]] = [
        [None, [], {}] if lost(r) else [None, [STEP], {str(partner(r, world)): [STEP]}]
        for r in range(world)
    ]
    tables = iter([_encoded(rows), _encoded([[None, None]] * world), _encoded([True] * world)])
    comm = Gathered(world, tables)
    gc.collect()
    start = time.perf_counter()
    found = step_choice._in_memory(comm, _Memory(world), set(), None)  # type: ignore[arg-type]
    chosen = comm.broadcast(comm.together("finding a checkpoint", lambda: [max(found), None]))
    holders = found[chosen[0]]
    if sorted(holders) != [r for r in range(world) if lost(r)]:
        raise AssertionError(f"step agreement: wrong lost ranks {sorted(holders)}")
    comm.all_gather(True)
    return time.perf_counter() - start, comm.exchanges


def heal_plan(world: int) -> tuple[float, int]:
    """`heal`'s planning: every rank's row (its live step, the records it holds, its
    peers: None, data parallel), checked and planned, then the live ranks' digests
    checked and compared (`_agree`). (seconds, exchanges)."""
    rows = [
        {"live": None if lost(r) else STEP, "held": {str(partner(r, world)): [STEP]}, "peers": None}
        for r in range(world)
    ]
    digest = "0123456789abcdef"
    tables = iter(
        [_encoded(rows), _encoded([None if lost(r) else [digest, None] for r in range(world)])]
    )
    comm = Gathered(world, tables)
    gc.collect()
    start = time.perf_counter()
    chosen = live.plan(messages.rows(comm.all_gather(rows[0]), world))
    if chosen is None or len(chosen.source) != LOCAL:
        raise AssertionError(f"heal plan: no plan for the {LOCAL} lost ranks")
    digests = messages.digests(comm.all_gather([digest, None]), world)
    if not live._agree(digests, chosen.step):
        raise AssertionError("heal plan: the replicas' digests disagree")
    return time.perf_counter() - start, comm.exchanges


def save_plan(world: int, tensors: int) -> tuple[float, bytes]:
    """A save's metadata on rank 0: every rank's blocks (``tensors`` sharded over every
    rank) decoded, the shared ones found, the write plan made, the manifest encoded.
    (seconds, the manifest)."""
    wire = rows_of(world, tensors)
    gc.collect()
    start = time.perf_counter()
    manifest = unbroken_save(wire, gc_paused.building)
    return time.perf_counter() - start, manifest


def manifest_validation(manifest: bytes) -> float:
    """A restore's metadata on every rank: the manifest parsed and validated."""
    gc.collect()
    start = time.perf_counter()
    Manifest.from_json(manifest, "scale")
    return time.perf_counter() - start


def measure(world: int, tensors: int) -> dict[str, dict[str, Any]]:
    """The four phases at ``world`` ranks: seconds, exchanges and their ring steps."""
    agreement, agreement_x = step_agreement(world)
    heal, heal_x = heal_plan(world)
    save, manifest = save_plan(world, tensors)
    validation = manifest_validation(manifest)

    def row(seconds: float, exchanges: int, note: str) -> dict[str, Any]:
        return {"s": seconds, "requests": 0, "exchanges": exchanges,
                "ring_steps": exchanges * (world - 1), "note": note}  # fmt: skip

    return {
        "step agreement": row(agreement, agreement_x, "rank 0 CPU; eager group: no request"),
        "heal plan": row(heal, heal_x, "rank 0 CPU; eager group: no request"),
        "save plan": row(save, 3, f"rank 0 CPU, {tensors} tensors x {world} ranks"),
        "manifest validation": row(validation, 0, f"{len(manifest) / 2**20:.1f} MiB manifest"),
    }
