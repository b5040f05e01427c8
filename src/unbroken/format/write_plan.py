"""Who writes what: a pure function from every rank's tensor blocks to a write plan.

Each rank describes the blocks it holds (key, region, checksum). Blocks with the same key,
region and checksum on several ranks are the same bytes (DDP parameters, optimizer state,
replicated DTensor placements): they are written once, by one of their holders, with the
bytes spread evenly over the ranks. Blocks whose value differs between ranks (RNG-seeded
buffers, per-rank state) are each written once and tagged with the ranks they belong to.
Comparing checksums instead of trusting a "replicated" flag means a tensor that silently
diverged between ranks is saved faithfully rather than replaced by rank 0's copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.errors import CheckpointError
from unbroken.format.layout import Chunk, TensorEntry


@dataclass(kw_only=True, slots=True)
class Block:
    """A tensor block held by one rank, described without its bytes. Not frozen: rank 0
    decodes one per block of the job to plan a save, and a frozen dataclass is built
    three times slower. Treat it as a value: `dataclasses.replace` makes a changed one."""

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

    def to_json(self) -> list[object]:
        return [self.key, self.dtype, self.shape, self.offsets, self.local_shape, self.nbytes,
                self.xxh3, self.pieces, self.piece_bytes, self.alias_of]  # fmt: skip

    @classmethod
    def from_json(cls, row: list[object]) -> Block:
        key, dtype, shape, offsets, local_shape, nbytes, xxh3, pieces, piece_bytes, alias = row
        return cls(
            key=str(key),
            dtype=str(dtype),
            shape=tuple(shape),  # type: ignore[arg-type]
            offsets=tuple(offsets),  # type: ignore[arg-type]
            local_shape=tuple(local_shape),  # type: ignore[arg-type]
            nbytes=int(nbytes),  # type: ignore[call-overload]
            xxh3=str(xxh3),
            pieces=pieces,  # type: ignore[arg-type]
            piece_bytes=piece_bytes,  # type: ignore[arg-type]
            alias_of=alias,  # type: ignore[arg-type]
        )


@dataclass(kw_only=True)
class WritePlan:
    """Who writes which block of a save, and where each block goes in the manifest."""

    tensors: dict[str, TensorEntry]
    # writes[rank] lists the keys that rank writes; chunk_of[(rank, key)] is where it goes.
    writes: list[list[str]]
    chunk_of: dict[tuple[int, str], Chunk]


def make_plan(blocks_by_rank: list[list[Block]]) -> WritePlan:
    """Deterministic: every rank computes the same plan from the same gathered input."""
    world = len(blocks_by_rank)
    aliases = _aliases(blocks_by_rank)
    tensors: dict[str, TensorEntry] = {}
    holders: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
    first: dict[tuple[str, tuple[int, ...], str], Block] = {}
    seen: dict[str, tuple[int, Block]] = {}  # each key's first holder and block
    for rank, blocks in enumerate(blocks_by_rank):
        for b in blocks:
            if b.key in aliases:
                continue
            if (known := seen.get(b.key)) is None:
                seen[b.key] = rank, b
                tensors[b.key] = TensorEntry(dtype=b.dtype, shape=list(b.shape))
            elif known[1].dtype != b.dtype or known[1].shape != b.shape:
                raise CheckpointError(
                    f"tensor {b.key!r} is {known[1].dtype}{list(known[1].shape)} on rank "
                    f"{known[0]} but {b.dtype}{list(b.shape)} on rank {rank}; "
                    "every rank must save the same dtype and global shape under one key"
                )
            ident = (b.key, b.offsets, b.xxh3)
            if (ranks := holders.get(ident)) is None:
                holders[ident], first[ident] = [rank], b
            else:
                ranks.append(rank)

    values_per_region: dict[tuple[str, tuple[int, ...]], int] = {}
    for key, offsets, _ in holders:
        values_per_region[key, offsets] = values_per_region.get((key, offsets), 0) + 1

    writes: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    chunk_of: dict[tuple[int, str], Chunk] = {}
    # Largest first onto the least-loaded holder: a greedy balance within ~1 block of ideal.
    for ident in sorted(holders, key=lambda i: (-first[i].nbytes, i)):
        b, ranks = first[ident], holders[ident]
        writer = ranks[0] if len(ranks) == 1 else min(ranks, key=lambda r: (load[r], r))
        load[writer] += b.nbytes
        chunk = Chunk(
            offsets=list(b.offsets),
            shape=list(b.local_shape),
            xxh3=b.xxh3,
            pieces=b.pieces,
            piece_bytes=b.piece_bytes,
            ranks=ranks if values_per_region[b.key, b.offsets] > 1 else None,
        )
        tensors[b.key].chunks.append(chunk)
        writes[writer].append(b.key)
        chunk_of[writer, b.key] = chunk
    for entry in tensors.values():
        entry.chunks.sort(key=lambda c: (c.offsets, c.ranks or []))
    for key, original in aliases.items():  # the same chunks: both keys name the same bytes
        b = next(b for blocks in blocks_by_rank for b in blocks if b.key == key)
        tensors[key] = TensorEntry(
            dtype=b.dtype, shape=list(b.shape), chunks=tensors[original].chunks
        )
    return WritePlan(tensors=tensors, writes=writes, chunk_of=chunk_of)


def _aliases(blocks_by_rank: list[list[Block]]) -> dict[str, str]:
    """Keys stored as their original's bytes (tied tensors, e.g. an embedding and an output
    layer sharing one weight): those every rank holding them holds as the same alias of
    the same original, which those same ranks hold. Anything else is stored as usual."""
    if not any(b.alias_of for blocks in blocks_by_rank for b in blocks):
        return {}  # the usual case, found in one quick pass
    seen: dict[str, set[str | None]] = {}
    holders: dict[str, set[int]] = {}
    for rank, blocks in enumerate(blocks_by_rank):
        for b in blocks:
            seen.setdefault(b.key, set()).add(b.alias_of)
            holders.setdefault(b.key, set()).add(rank)
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
