"""Who writes what: a pure function from every rank's tensor blocks to a write plan.

Each rank describes the blocks it holds (key, region, checksum). Blocks with the same key,
region and checksum on several ranks are the same bytes (DDP parameters, optimizer state,
replicated DTensor placements): they are written once, by one of their holders, with the
bytes spread evenly over the ranks. Blocks whose value differs between ranks (RNG-seeded
buffers, per-rank state) are each written once and tagged with the ranks they belong to.
Comparing checksums instead of trusting a "replicated" flag means a tensor that silently
diverged between ranks is saved faithfully rather than replaced by rank 0's copy.

Rank 0 plans over every block of the job (2,304 ranks x 100 tensors: 230,400), so the
plan reads the blocks as they arrive, `Block.to_json` rows, and builds nothing per block
but what a region several ranks hold needs: a region one rank alone holds (a shard) is
that rank's to write. The writers encode their own manifest chunks (`layout.Chunk`);
the plan says where each goes in its tensor (`WritePlan.order`).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from unbroken.errors import CheckpointError

# A block as `Block.to_json` encodes it; its shapes are lists once it has travelled (a
# rank's blocks are compared with another's only then: one process plans its own alone).
Row = list[Any]
# A key and a block's offsets in it, flat: one tuple per block of the job on rank 0.
Region = tuple[Any, ...]
# A chunk's place among its tensor's chunks: its region, then the ranks it names if any
# (flat: the offsets of one tensor's chunks all have its rank of dimensions).
Order = tuple[Any, ...]


@dataclass(kw_only=True, slots=True)
class Block:
    """A tensor block held by one rank, described without its bytes. Treat it as a value:
    `dataclasses.replace` makes a changed one."""

    key: str
    dtype: str
    shape: tuple[int, ...]  # global shape
    offsets: tuple[int, ...]  # where the block sits in the global tensor
    local_shape: tuple[int, ...]
    nbytes: int
    xxh3: str
    pieces: list[str] | None = None  # see format.Checksums
    piece_bytes: int | None = None
    alias_of: str | None = None  # the key of a block sharing this one's storage (tied)

    def to_json(self) -> Row:
        return [self.key, self.dtype, self.shape, self.offsets, self.local_shape, self.nbytes,
                self.xxh3, self.pieces, self.piece_bytes, self.alias_of]  # fmt: skip

    @classmethod
    def from_json(cls, row: Row) -> Block:
        key, dtype, shape, offsets, local_shape, nbytes, xxh3, pieces, piece_bytes, alias = row
        return cls(
            key=str(key), dtype=str(dtype), shape=tuple(shape), offsets=tuple(offsets),
            local_shape=tuple(local_shape), nbytes=int(nbytes), xxh3=str(xxh3),
            pieces=pieces, piece_bytes=piece_bytes, alias_of=alias,
        )  # fmt: skip


@dataclass(kw_only=True)
class Survey:
    """Every rank's blocks, surveyed once before any is hashed (`survey`)."""

    tensors: dict[str, tuple[str, list[int]]]  # key -> dtype, global shape; manifest order
    aliases: dict[str, str]  # a tied key -> the key whose bytes it names
    holders: dict[Region, int]  # each region -> the first rank holding it
    shared: dict[Region, list[int]]  # each region several ranks hold -> them, in rank order
    held: list[int]  # each rank's bytes, tied keys aside
    # Per rank, its blocks whose region another rank holds too (kept: nothing else is).
    shared_rows: list[list[Row]]

    @property
    def early(self) -> list[list[str]]:
        """Per rank, the keys of its blocks whose region another rank holds too: hashed
        before the plan, which tells equal replicas from per-rank values by checksum."""
        return [[row[0] for row in rows] for rows in self.shared_rows]


@dataclass(kw_only=True)
class WritePlan:
    """Who writes which block of a save, and where each block goes in the manifest."""

    tensors: dict[str, tuple[str, list[int]]]  # as `Survey.tensors`
    aliases: dict[str, str]
    # writes[rank] lists the keys that rank writes; order[rank] each one's `Order`, the
    # chunks of a tensor being sorted by it; tags[rank] the ranks a chunk names.
    writes: list[list[str]]
    order: list[list[Order]]
    tags: list[dict[str, list[int]]]


def survey(rows_by_rank: list[list[Row]]) -> Survey:
    """One pass over every block: each key's dtype and global shape, the same on every
    rank that holds it (else `CheckpointError`), and the ranks holding each region."""
    aliases = _aliases(rows_by_rank)
    tensors: dict[str, tuple[str, list[int]]] = {}
    first: dict[str, int] = {}  # each key's first holder
    holders: dict[Region, int] = {}  # each region's first holder
    shared: dict[Region, list[int]] = {}  # the regions several ranks hold: all of them
    held = [0] * len(rows_by_rank)  # each rank's bytes, tied keys aside
    for rank, rows in enumerate(rows_by_rank):
        for key, dtype, shape, offsets, _, nbytes, _, _, _, _ in rows:
            region = (key, *offsets)
            if (holder := holders.setdefault(region, rank)) != rank:
                shared.setdefault(region, [holder]).append(rank)
            if key in aliases:  # stored as its original, which is checked
                tensors.setdefault(key, (dtype, shape))
            elif (known := tensors.get(key)) is None:
                tensors[key], first[key] = (dtype, shape), rank
                held[rank] += nbytes
            elif known[0] == dtype and known[1] == shape:
                held[rank] += nbytes
            else:
                raise CheckpointError(
                    f"tensor {key!r} is {known[0]}{known[1]} on rank {first[key]} but "
                    f"{dtype}{shape} on rank {rank}; every rank must save the same dtype "
                    "and global shape under one key"
                )
    if aliases:  # stored as their originals' chunks: last in the manifest, as ever
        tensors = {k: v for k, v in tensors.items() if k not in aliases} | {
            k: tensors[k] for k in aliases
        }
    keys = {region[0] for region in shared}  # cheap to test first: a string's hash is kept
    shared_rows = [[r for r in rows if r[0] in keys and (r[0], *r[3]) in shared] if keys else []
                   for rows in rows_by_rank]  # fmt: skip
    return Survey(tensors=tensors, aliases=aliases, holders=holders, shared=shared, held=held,
                  shared_rows=shared_rows)  # fmt: skip


def make_plan(surveyed: Survey, sums_by_rank: list[dict[str, dict[str, Any]]]) -> WritePlan:
    """Deterministic: the same survey and checksums give the same plan. ``sums_by_rank``:
    each rank's checksums of its `Survey.early` keys (else a row's own ``xxh3``)."""
    world = len(surveyed.held)
    writes: list[list[str]] = [[] for _ in range(world)]
    order: list[list[Order]] = [[] for _ in range(world)]
    tags: list[dict[str, list[int]]] = [{} for _ in range(world)]
    load = list(surveyed.held)  # less the shared regions' bytes, below
    aliases, shared = surveyed.aliases, surveyed.shared
    single = surveyed.holders.items()  # one holder: it writes, whatever it is
    if shared or aliases:
        single = {g: r for g, r in single if g not in shared and g[0] not in aliases}.items()
    for region, rank in single:
        writes[rank].append(region[0])
        order[rank].append(region)
    # Each value of a shared region: its size and its holders.
    values: dict[Region, tuple[int, list[int]]] = {}  # region, then checksum
    for rank, rows in enumerate(surveyed.shared_rows):
        sums = sums_by_rank[rank]
        for row in rows:
            if (region := (row[0], *row[3])) in shared and row[0] not in aliases:
                load[rank] -= row[5]
                xxh3 = sums[row[0]]["xxh3"] if row[0] in sums else row[6]
                values.setdefault((*region, xxh3), (row[5], []))[1].append(rank)
    per_region: dict[Region, int] = {}
    for ident in values:
        per_region[ident[:-1]] = per_region.get(ident[:-1], 0) + 1
    # Largest first onto the least-loaded holder: a greedy balance within ~1 block of ideal.
    for ident in sorted(values, key=lambda i: (-values[i][0], i)):
        nbytes, ranks = values[ident]
        writer = min(ranks, key=lambda r: (load[r], r))
        load[writer] += nbytes
        tagged = per_region[ident[:-1]] > 1
        writes[writer].append(ident[0])
        order[writer].append(ident[:-1] + tuple(ranks) if tagged else ident[:-1])
        if tagged:
            tags[writer][ident[0]] = ranks
    return WritePlan(tensors=surveyed.tensors, aliases=surveyed.aliases, writes=writes,
                     order=order, tags=tags)  # fmt: skip


def _aliases(rows_by_rank: list[list[Row]]) -> dict[str, str]:
    """Keys stored as their original's bytes (tied tensors, e.g. an embedding and an output
    layer sharing one weight): those every rank holding them holds as the same alias of
    the same original, which those same ranks hold. Anything else is stored as usual."""
    if not any(any(map(itemgetter(9), rows)) for rows in rows_by_rank):
        return {}  # the usual case, found in one quick pass
    seen: dict[str, set[str | None]] = {}
    holders: dict[str, set[int]] = {}
    for rank, rows in enumerate(rows_by_rank):
        for row in rows:
            seen.setdefault(row[0], set()).add(row[9])
            holders.setdefault(row[0], set()).add(rank)
    aliases = {}
    for key, originals in seen.items():
        [original] = originals if len(originals) == 1 else [None]
        if (
            original is not None
            and holders[key] == holders.get(original)
            and seen[original] == {None}
        ):
            aliases[key] = original
    return aliases
