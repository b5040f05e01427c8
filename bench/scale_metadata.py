# mypy: disallow-untyped-defs
"""The scale harness's per-rank phases (bench/scale.py): step agreement, heal plan, save
plan, manifest validation. Each runs unbroken's own code on one rank, with every other
rank's part of each exchange made up front, untimed, as those ranks would send it.

What is real: `unbroken.restoring.step_choice._in_memory` (the step every rank can get
from shared memory, and who holds each lost rank's copy) and `unbroken.healing.plan.plan`
with `unbroken.healing.messages` checking the gathered rows and digests, on rank 0 (the
busiest: it also picks the step); the save's metadata as `unbroken.saving.pipeline`
makes it in its three `Comm.planned` exchanges: rank 0's `unbroken.saving.planning.Planner`
(every rank's blocks decoded and surveyed, `write_plan.make_plan`, every rank's part
encoded, the manifest joined from the chunks the writers encoded), timed apart, and a
non-planning rank's (rank 1: its rows encoded, its parts decoded, its chunks encoded); a
restore rank's part of the manifest (`unbroken.format.layout.parse` with its part, the
verdicts' exchange as `StorageSource.validate` makes it, `Manifest.built`), and, beside
it, the whole manifest checked as every rank did before (``whole_s``). `Gathered` stands in for
`unbroken.job.comm.Comm` in the first two: its ``all_gather`` does the JSON work
`Comm.all_gather` does on a rank (its own row encoded, every row decoded, the collector
paused), and moves no bytes. So the times are CPU on the critical path of a rank (the
thread's CPU time: `clock`); the transport is not in them: an all_gather is a
gather on rank 0 and a broadcast down gloo's binomial tree, ``2 + 2 * ceil(log2 n)``
sequential steps (``steps``; on a group already connected, no store request), with
``2 (n - 1)`` messages at rank 0 (``root_messages``: the lengths, then the rows); a
planned exchange is the same gather to rank 0 and a scatter from it (the longest part's
size broadcast first): ``3 + 2 * ceil(log2 n)`` steps, ``3 (n - 1)`` messages at rank 0.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from metadata import COLS, ROWS, SHARD
from scale_hosts import LOCAL
from unbroken.format.layout import Chunk, Manifest, parse
from unbroken.format.write_plan import Block
from unbroken.healing import live, messages, plan
from unbroken.job import gc_paused
from unbroken.restoring import step_choice
from unbroken.saving.planning import Planner

# A rank's CPU: this thread's, so that other work on the machine does not count in it
# (the phases here are single-threaded Python; on an idle machine it is the wall time).
clock = time.thread_time
STEP = 1000  # the step every live rank is at, and the newest snapshot in memory
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
    start = clock()
    found = step_choice._in_memory(comm, _Memory(world), set(), None)  # type: ignore[arg-type]
    chosen = comm.broadcast(comm.together("finding a checkpoint", lambda: [max(found), None]))
    holders = found[chosen[0]]
    if sorted(holders) != [r for r in range(world) if lost(r)]:
        raise AssertionError(f"step agreement: wrong lost ranks {sorted(holders)}")
    comm.all_gather(True)
    return clock() - start, comm.exchanges


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
    start = clock()
    chosen = plan.plan(messages.rows(comm.all_gather(rows[0]), world))
    if chosen is None or len(chosen.source) != LOCAL:
        raise AssertionError(f"heal plan: no plan for the {LOCAL} lost ranks")
    digests = messages.digests(comm.all_gather([digest, None]), world)
    if not live._agree(digests, chosen.step):
        raise AssertionError("heal plan: the replicas' digests disagree")
    return clock() - start, comm.exchanges


def _blocks(world: int, tensors: int, rank: int) -> list[Block]:
    """Rank ``rank``'s blocks as bench/metadata.py lays them out (FSDP: every tensor
    sharded over every rank), before hashing (`unbroken.saving.checksums.layout`)."""
    return [
        Block(key=f"layers.{t}.weight", dtype="BF16", shape=(world * ROWS, COLS),
              offsets=(rank * ROWS, 0), local_shape=(ROWS, COLS), nbytes=SHARD, xxh3="")
        for t in range(tensors)
    ]  # fmt: skip


def _write_row(blocks: list[Block], rank: int) -> list[Any]:
    """What `pipeline._write` returns: the manifest chunk of each block it wrote (the
    rank alone holds its blocks, hashed while writing), the file's size, the rank's tree."""
    name, at, chunks = f"r{rank:05d}-000.safetensors", 4096, []
    for i, b in enumerate(blocks):
        chunk = Chunk(offsets=list(b.offsets), shape=list(b.local_shape), file=name, start=at,
                      end=at + b.nbytes, xxh3=f"{rank * len(blocks) + i:016x}")  # fmt: skip
        chunks.append(chunk.to_text())
        at += b.nbytes
    return [chunks, {name: at}, {"progress": {"step": STEP}}]


def _wire(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _planned(rows: list[bytes], plan: Callable[[list[Any]], list[Any]]) -> list[bytes]:
    """Rank 0's side of `Comm.planned`, less the error column: every rank's row decoded
    and planned with the collector paused throughout (`Comm.gather`), the parts encoded."""
    with gc_paused.building():
        parts = plan([json.loads(r)[1] for r in rows])
    return [_wire([None, p]) for p in parts]


def save_plan(world: int, tensors: int) -> tuple[float, float, bytes]:
    """A save's metadata, as `unbroken.saving.pipeline._persist` makes it through its
    three `Comm.planned` exchanges: (a non-planning rank's seconds, rank 0's seconds,
    the manifest). Rank 1 encodes its rows and decodes its parts; rank 0 decodes every
    rank's rows, plans (`unbroken.saving.planning.Planner`), encodes every rank's part
    and the manifest. Every other rank's rows are made up front, untimed."""
    rows = [_wire([None, [STEP, False, [b.to_json() for b in _blocks(world, tensors, r)], []]])
            for r in range(world)]  # fmt: skip
    written = [_wire([None, _write_row(_blocks(world, tensors, r), r)]) for r in range(world)]
    gc.collect()
    start = clock()
    planner = Planner(step=STEP, replicated=None, storage=None)
    parts = _planned(rows, planner.layout)
    writes = _planned([_wire([None, {}])] * world, planner.writes)  # FSDP: nothing held twice
    _planned(written, planner.wrote)
    manifest = planner.manifest(world, 0.0).to_json()
    planning = clock() - start
    gc.collect()
    start = clock()  # rank 1: its rows out, its parts in
    blocks = _blocks(world, tensors, 1)
    _wire([None, [STEP, False, [b.to_json() for b in blocks], []]])
    _, (_, _, early) = json.loads(parts[1])  # as `Comm.scatter` decodes
    _wire([None, {}])
    _, (keys, _) = json.loads(writes[1])
    if sorted(keys) != sorted(b.key for b in blocks) or early:
        raise AssertionError("save plan: rank 1 was not given its own blocks to write")
    _wire([None, _write_row(blocks, 1)])
    json.loads(_wire([None, None]))
    return clock() - start, planning, manifest


def manifest_validation(manifest: bytes, world: int) -> tuple[float, float]:
    """A restore's metadata on a rank (rank 0, whose part is as large as any): the
    manifest parsed, its header and its part checked (`unbroken.format.layout.parse`),
    the verdicts exchanged (`StorageSource.validate`: one all_gather of ``world``
    nulls), the manifest built; and, for comparison, the whole manifest checked, as
    every rank did before. (seconds, seconds whole)."""
    verdicts = _wire([None] * world)
    gc.collect()
    start = clock()
    raw = parse(manifest, "scale", (0, world))
    _wire(None)
    if any(json.loads(verdicts)):
        raise AssertionError("manifest validation: a part was refused")
    Manifest.built(raw, "scale")
    part = clock() - start
    gc.collect()
    start = clock()
    Manifest.from_json(manifest, "scale")
    return part, clock() - start


def planned_steps(world: int) -> int:
    """Sequential steps of `unbroken.job.comm.Comm.planned`: the lengths gathered on rank 0
    and broadcast down the tree, the rows gathered; the size broadcast, the scatter."""
    return 3 + 2 * math.ceil(math.log2(world)) if world > 1 else 0


def gather_steps(world: int) -> int:
    """Sequential steps of `unbroken.job.comm`'s all-gather: two gathers on rank 0, and
    two broadcasts down a binomial tree."""
    return 2 + 2 * math.ceil(math.log2(world)) if world > 1 else 0


def measure(world: int, tensors: int) -> dict[str, dict[str, Any]]:
    """The four phases at ``world`` ranks: seconds, exchanges and their sequential steps."""
    agreement, agreement_x = step_agreement(world)
    heal, heal_x = heal_plan(world)
    save, planning, manifest = save_plan(world, tensors)
    validation, whole = manifest_validation(manifest, world)

    def row(seconds: float, exchanges: int, note: str) -> dict[str, Any]:
        return {"s": seconds, "requests": 0, "exchanges": exchanges,
                "steps": exchanges * gather_steps(world),
                "root_messages": exchanges * 2 * (world - 1), "note": note}  # fmt: skip

    return {
        "step agreement": row(agreement, agreement_x, "rank 0 CPU; group connected: no request"),
        "heal plan": row(heal, heal_x, "rank 0 CPU; group connected: no request"),
        "save plan": {
            **row(save, 3, f"rank 1 CPU; rank 0 plans in {planning:.3f} s ({tensors} tensors)"),
            "steps": 3 * planned_steps(world),
            "root_messages": 3 * 3 * (world - 1),
            "planner_s": planning,
        },
        "manifest validation": {
            **row(validation, 1, f"rank 0 CPU, its part of {len(manifest) / 2**20:.1f} MiB"),
            "whole_s": whole,
        },
    }
