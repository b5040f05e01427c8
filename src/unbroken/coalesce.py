"""Reads from object storage, coalesced across a whole file.

On an object store a request costs a round trip whatever its size, so reading block by
block (hundreds of tensors of a few MiB) leaves the connection idle between requests.
Here the blocks a rank needs are merged into runs of neighbouring bytes in each file
(across tensor boundaries, small gaps read and dropped), and each run is cut into equal
ranged GETs: all files' pieces go to one pool, ``requests_in_flight`` deep, so every
connection stays busy to the end. Pieces are ``part_size`` bytes at most, and smaller
when the whole read would otherwise not fill the pool. Each block is verified against its
checksum once all its bytes are in, before anyone can use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from unbroken.blockio import byte_view, read_into, verify_chunk
from unbroken.format import Chunk, TensorEntry
from unbroken.storage import Storage

GAP_BYTES = 256 << 10  # bytes between two blocks read and dropped rather than split a run
# Pieces never get smaller than this: on a server with a few ms per request (moto here,
# 7 ms for 4 KiB) a 1 MiB piece spends as long waiting as moving bytes.
MIN_PIECE = 8 << 20
Item = tuple[str, TensorEntry, Chunk, torch.Tensor]


@dataclass
class Piece:
    """One ranged GET: ``file`` bytes [start, end), and where they go: ``(offset in the
    piece, destination bytes, key)``."""

    file: str
    start: int
    end: int
    targets: list[tuple[int, memoryview, str]] = field(default_factory=list)


def plan(items: Sequence[Item], piece: int) -> list[Piece]:
    """The GETs that read every item's chunk into its tensor, at most ``piece`` bytes
    each."""
    ordered = sorted(items, key=lambda item: (item[2].file, item[2].start))
    runs: list[list[Item]] = []
    for item in ordered:
        chunk, last = item[2], runs[-1][-1][2] if runs else None
        near = last is not None and last.file == chunk.file
        if near and last is not None and 0 <= chunk.start - last.end <= GAP_BYTES:
            runs[-1].append(item)
        else:
            runs.append([item])
    pieces = []
    for run in runs:
        first, end = run[0][2], run[-1][2].end
        cuts = [Piece(first.file, s, min(s + piece, end)) for s in range(first.start, end, piece)]
        i = 0
        for key, _, chunk, out in run:
            view = byte_view(out)
            while cuts[i].end <= chunk.start:
                i += 1
            j = i
            while j < len(cuts) and cuts[j].start < chunk.end:
                lo, hi = max(cuts[j].start, chunk.start), min(cuts[j].end, chunk.end)
                cuts[j].targets.append(
                    (lo - cuts[j].start, view[lo - chunk.start : hi - chunk.start], key)
                )
                j += 1
        pieces += cuts
    return pieces


def piece_size(items: Sequence[Item], part_size: int, in_flight: int) -> int:
    """``part_size``, or less when the bytes would not otherwise give every request slot
    a piece (one request for 16 MiB leaves 15 connections idle)."""
    total = sum(item[2].nbytes for item in items)
    return min(part_size, max(MIN_PIECE, -(-total // max(1, in_flight))))


def read_coalesced(
    storage: Storage, folder: str, items: Sequence[Item], threads: int, part_size: int,
    verify: bool = True,
) -> None:  # fmt: skip
    """Read whole chunks into ``out`` tensors (contiguous, CPU, the chunk's dtype and
    shape), as few and as evenly sized GETs as the layout allows; verify each chunk."""
    in_flight = max(threads, storage.requests_in_flight)
    pieces = plan(items, piece_size(items, part_size, in_flight))

    def get(piece: Piece) -> None:
        size = piece.end - piece.start
        only = piece.targets[0] if len(piece.targets) == 1 else None
        if only is not None and only[0] == 0 and len(only[1]) == size:
            read_into(storage, folder, only[2], piece.file, piece.start, only[1])
            return
        data = memoryview(bytearray(size))
        read_into(storage, folder, piece.targets[0][2], piece.file, piece.start, data)
        for offset, view, _ in piece.targets:
            view[:] = data[offset : offset + len(view)]

    def check(item: Item) -> None:
        verify_chunk(folder, item[0], item[2], byte_view(item[3]))

    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(get, pieces))
        if verify:
            list(pool.map(check, items))
