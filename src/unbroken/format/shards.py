"""Moving tensor bytes between memory and shard files.

Writes go straight from tensor memory to storage (no serialisation buffer); reads go
straight from storage into the destination tensor when its layout allows, so restoring
into an existing model touches each byte once. Every block read is checked against its
manifest checksum before anyone can use it; a part of a block (restoring on another
number of ranks) is read and checked by whole checksum pieces (`fill_regions`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from unbroken.errors import CheckpointError
from unbroken.format.blockio import read_into, run_all, verify_chunk
from unbroken.format.coalesce import Extent, fetch, fetch_held
from unbroken.format.layout import Chunk, TensorEntry, safetensors_header, shard_file, verify_block
from unbroken.run import faults
from unbroken.storage import Storage

# A rank's data is split into files of about this size, written by parallel threads.
FILE_BYTES = 512 << 20
# Blocks packed into one buffer each start on a cache line, so typed views are valid.
ALIGN = 64


def packed(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Where blocks of ``sizes`` bytes start when packed back to back into one buffer,
    each at an `ALIGN`-byte boundary, and the buffer's size."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // ALIGN) * ALIGN
    return starts, total


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def local_block(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The part of ``t`` this rank holds, contiguous, and its offsets in the global tensor.
    A DTensor contributes its local shard; anything else is whole."""
    if isinstance(t, DTensor):
        local, offsets = t.to_local(), dtensor_offsets(t)
    else:
        local, offsets = t, (0,) * t.dim()
    return local.detach().contiguous(), offsets


def dtensor_offsets(t: DTensor) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(offsets)


def write_blocks(
    storage: Storage, folder: str, rank: int, blocks: Sequence[tuple[str, torch.Tensor]],
    threads: int,
) -> tuple[dict[str, tuple[str, int, int]], dict[str, int]]:  # fmt: skip
    """Write ``(key, tensor)`` blocks into this rank's shard files under ``folder``.

    Returns where each key went, ``{key: (file, start, end)}``, and ``{file: size}``."""
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    filled = 0
    for key, t in blocks:
        if filled >= FILE_BYTES:
            files.append([])
            filled = 0
        files[-1].append((key, t))
        filled += t.nbytes

    locations: dict[str, tuple[str, int, int]] = {}
    sizes: dict[str, int] = {}

    def write_one(index: int) -> None:
        name = shard_file(rank, index)
        content = files[index]
        header = safetensors_header([(k, t.dtype, list(t.shape), t.nbytes) for k, t in content])
        where, pos = {}, len(header)
        for key, t in content:
            where[key] = (name, pos, pos + t.nbytes)
            pos += t.nbytes
        faults.point("data-write")
        storage.write(f"{folder}/{name}", [header, *(byte_view(t) for _, t in content)])
        locations.update(where)  # files hold distinct keys
        sizes[name] = pos

    # On the process's IO workers (one file, the common case: on this thread), not on a
    # pool started for every save.
    run_all(write_one, range(len(files)), threads)
    return locations, sizes


def read_chunk(
    storage: Storage, folder: str, key: str, entry: TensorEntry, chunk: Chunk,
    out: torch.Tensor | None = None, verify: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Read ``chunk`` into ``out`` (a contiguous CPU tensor of its dtype and shape, or a new
    one) and verify its checksum (``verify=False``: the caller just verified the source)."""
    if out is None:
        out = torch.empty(chunk.shape, dtype=entry.torch_dtype)
    view = byte_view(out)
    read_into(storage, folder, key, chunk.file, chunk.start, view)
    if verify:
        verify_chunk(folder, key, chunk, view)
    return out


def read_many(
    storage: Storage, folder: str,
    items: Sequence[tuple[str, TensorEntry, Chunk, torch.Tensor]], threads: int,
    verify: bool = True,
) -> None:  # fmt: skip
    """Read whole chunks into ``out`` tensors (contiguous, CPU, the chunk's dtype and
    shape), verifying each as soon as it is in unless ``verify=False``; neighbouring
    chunks share requests as the storage's `unbroken.format.coalesce.Rules` say."""
    extents = [Extent(key, c.file, c.start, c.end) for key, _, c, _ in items]
    views: list[memoryview | None] = [byte_view(out) for _, _, _, out in items]

    def done(i: int, view: memoryview) -> None:
        if verify:
            verify_chunk(folder, items[i][0], items[i][2], view)

    fetch(storage, folder, extents, views, done, threads)


def read_held(
    storage: Storage, folder: str, items: Sequence[tuple[str, TensorEntry, Chunk, torch.Tensor]],
    threads: int,
) -> Callable[[], None]:  # fmt: skip
    """`read_many`, verified, for a storage that hands over what it read without a copy
    (``read_range``: S3's responses, a local file's mapped pages), writing nothing yet:
    the returned ``place()`` copies every chunk into its ``out`` tensor. Until it is
    called a failure, here or on another rank, leaves the tensors as they were, at no
    cost: the bytes a read has to bring in anyway stand in for the copy of the state a
    `Backup` would take."""
    extents = [Extent(key, c.file, c.start, c.end) for key, _, c, _ in items]
    held: dict[int, list[memoryview]] = {}

    def done(i: int, pieces: list[memoryview]) -> None:
        verify_chunk(folder, items[i][0], items[i][2], pieces)
        held[i] = pieces

    fetch_held(storage, folder, extents, done, threads)

    def place() -> None:
        for i, pieces in held.items():
            out, at = byte_view(items[i][3]), 0
            for piece in pieces:
                out[at : at + len(piece)] = piece
                at += len(piece)

    return place


def fill(
    storage: Storage, folder: str, key: str, entry: TensorEntry, chunks: Sequence[Chunk],
    dest: torch.Tensor, offsets: Sequence[int],
) -> None:  # fmt: skip
    """Fill ``dest``, the region of the global tensor at ``offsets``, from ``chunks``
    (one `fill_regions` target)."""
    direct = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == entry.torch_dtype
    for chunk in chunks:
        if direct and chunk.offsets == list(offsets) and chunk.shape == list(dest.shape):
            read_chunk(storage, folder, key, entry, chunk, out=dest)
            return
    fill_regions(storage, folder, [(key, entry, chunks, dest, offsets)], threads=1)


# -- regions cut from other blocks ----------------------------------------------------
#
# A restore onto another number of ranks fills each rank's shards from parts of the
# stored blocks. All of a rank's regions are planned together: each overlap becomes a
# byte span of its block (the pieces holding it, or the whole block if it has no
# pieces); spans back to back in one file are fetched in one request (a rank's shards of
# many small tensors sit together in the files of the ranks that saved them: one request
# instead of hundreds, which is what counts on object stores); each span is checked
# against its checksums before a byte of it is copied into a tensor.

# (key, entry, chunks, dest, offsets): fill ``dest``, the region at ``offsets`` of tensor
# ``key``, from those of ``chunks`` that overlap it.
Target = tuple[str, TensorEntry, Sequence[Chunk], torch.Tensor, Sequence[int]]

_DAMAGED = "; the file is damaged. Restore an earlier step (see `unbroken ls`)."


@dataclass(frozen=True)
class _Span:
    """Bytes ``[lo, hi)`` of ``chunk`` (relative to its start) holding the overlap
    ``region`` (global indices) of ``dest``, whose own region starts at ``offsets``."""

    key: str
    entry: TensorEntry
    chunk: Chunk
    lo: int
    hi: int
    region: list[tuple[int, int]]
    dest: torch.Tensor
    offsets: Sequence[int]

    @property
    def start(self) -> int:
        return self.chunk.start + self.lo

    @property
    def end(self) -> int:
        return self.chunk.start + self.hi


def fill_regions(storage: Storage, folder: str, targets: Sequence[Target], threads: int) -> None:
    """Fill every target; `CorruptCheckpointError` naming the tensor, file and bytes of
    a span that fails its checksum, `CheckpointError` if a region is not covered."""
    spans = []
    for key, entry, chunks, dest, offsets in targets:
        covered = 0
        for chunk in chunks:
            region = overlap(offsets, dest.shape, chunk.offsets, chunk.shape)
            if region is not None:
                spans.append(_span(key, entry, chunk, region, dest, offsets))
                covered += math.prod(hi - lo for lo, hi in region)
        if covered != dest.numel():
            raise CheckpointError(
                f"{folder}: the checkpoint does not hold all of tensor {key!r} for the region "
                f"at {list(offsets)} of shape {list(dest.shape)}"
            )

    extents = [Extent(s.key, s.chunk.file, s.start, s.end) for s in spans]
    # a span whose bytes are exactly its destination's is read straight into them
    direct = [_direct(s) for s in spans]

    def done(i: int, data: memoryview) -> None:
        if direct[i] is not None:
            _check(folder, spans[i], data)
        else:
            _place(folder, spans[i], data)

    fetch(storage, folder, extents, direct, done, threads)


def _span(
    key: str, entry: TensorEntry, chunk: Chunk, region: list[tuple[int, int]],
    dest: torch.Tensor, offsets: Sequence[int],
) -> _Span:  # fmt: skip
    """The bytes of ``chunk`` to read for ``region``: from the first to the last piece
    holding a byte of it (in C order), or the whole chunk if it has no pieces."""
    if chunk.pieces is None or chunk.piece_bytes is None:
        return _Span(key, entry, chunk, 0, chunk.nbytes, region, dest, offsets)
    size = torch.empty((), dtype=entry.torch_dtype).element_size()
    strides = _strides(chunk.shape)
    rel = [(lo - o, hi - o) for (lo, hi), o in zip(region, chunk.offsets, strict=True)]
    first = sum(lo * s for (lo, _), s in zip(rel, strides, strict=True)) * size
    last = sum((hi - 1) * s for (_, hi), s in zip(rel, strides, strict=True)) * size + size
    piece = chunk.piece_bytes
    lo_byte, hi_byte = first // piece * piece, min(-(-last // piece) * piece, chunk.nbytes)
    return _Span(key, entry, chunk, lo_byte, hi_byte, region, dest, offsets)


def _strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[dim + 1 :]) for dim in range(len(shape))]


def _direct(span: _Span) -> memoryview | None:
    """The destination's bytes for ``span``, if they are contiguous and the span's bytes
    are exactly theirs (a whole block, or whole pieces of rows): read straight into them."""
    dst = _narrowed(span)
    nbytes = dst.numel() * dst.element_size()
    if not dst.is_contiguous() or dst.device.type != "cpu" or nbytes != span.hi - span.lo:
        return None
    strides = _strides(span.chunk.shape)
    first = sum(
        (lo - o) * s for (lo, _), o, s in zip(span.region, span.chunk.offsets, strides, strict=True)
    )
    return byte_view(dst) if first * dst.element_size() == span.lo else None


def _narrowed(span: _Span) -> torch.Tensor:
    dst = span.dest
    for dim, (lo, hi) in enumerate(span.region):
        dst = dst.narrow(dim, lo - span.offsets[dim], hi - lo)
    return dst


def _place(folder: str, span: _Span, data: memoryview) -> None:
    """Check ``data`` (the span's bytes) against its checksums, then copy the overlap
    into the destination."""
    _check(folder, span, data)
    chunk = span.chunk
    dtype = span.entry.torch_dtype
    size = torch.empty((), dtype=dtype).element_size()
    flat = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
    strides = _strides(chunk.shape)
    first = sum(
        (lo - o) * s for (lo, _), o, s in zip(span.region, chunk.offsets, strides, strict=True)
    )
    src = flat.as_strided([hi - lo for lo, hi in span.region], strides, first - span.lo // size)
    _narrowed(span).copy_(src)


def _check(folder: str, span: _Span, data: memoryview) -> None:
    """Check ``data`` (the span's bytes) against the chunk's checksums."""
    chunk, where = span.chunk, f"{folder}: tensor {span.key!r} in {span.chunk.file}"
    if chunk.pieces is None or chunk.piece_bytes is None:
        verify_block(data, chunk.xxh3, f"{where} (bytes {chunk.start}-{chunk.end})", _DAMAGED)
    else:
        piece = chunk.piece_bytes
        for index in range(span.lo // piece, -(-span.hi // piece)):
            at, lo = index * piece - span.lo, chunk.start + index * piece
            hi = min(lo + piece, chunk.end)
            block = f"the block at {chunk.start}-{chunk.end}"
            what = f"{where} (bytes {lo}-{hi}, piece {index} of {block})"
            verify_block(data[at : at + piece], chunk.pieces[index], what, _DAMAGED)


def overlap(
    a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]
) -> list[tuple[int, int]] | None:
    """The region (``[lo, hi)`` per dimension) where two blocks overlap, or None."""
    region = []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape, strict=True):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        region.append((lo, hi))
    return region
