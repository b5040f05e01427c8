"""Moving tensor bytes between memory and shard files.

Writes go straight from tensor memory to storage (no serialisation buffer); reads go
straight from storage into the destination tensor when its layout allows, so restoring
into an existing model touches each byte once. Every block read is checked against its
manifest checksum before anyone can use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.tensor import DTensor

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format import Chunk, TensorEntry, safetensors_header, shard_file, verify_block
from unbroken.storage import Storage

# A rank's data is split into files of about this size, written by parallel threads.
FILE_BYTES = 512 << 20
# Blocks packed into one buffer each start on a cache line, so typed views are valid.
ALIGN = 64


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def packed(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Where blocks of ``sizes`` bytes start when packed back to back into one buffer,
    each at an `ALIGN`-byte boundary, and the buffer's size."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // ALIGN) * ALIGN
    return starts, total


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

    def write_one(index: int) -> tuple[str, dict[str, tuple[str, int, int]], int]:
        name = shard_file(rank, index)
        content = files[index]
        header = safetensors_header([(k, t.dtype, list(t.shape), t.nbytes) for k, t in content])
        where, pos = {}, len(header)
        for key, t in content:
            where[key] = (name, pos, pos + t.nbytes)
            pos += t.nbytes
        storage.write(f"{folder}/{name}", [header, *(byte_view(t) for _, t in content)])
        return name, where, pos

    locations: dict[str, tuple[str, int, int]] = {}
    sizes: dict[str, int] = {}
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        for name, where, size in pool.map(write_one, range(len(files))):
            locations.update(where)
            sizes[name] = size
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
    _read(storage, folder, key, chunk.file, chunk.start, view)
    if verify:
        _verify(folder, key, chunk, view)
    return out


def _read(storage: Storage, folder: str, key: str, file: str, start: int, out: memoryview) -> None:
    try:
        storage.read_into(f"{folder}/{file}", start, out)
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder}/{file} disappeared while tensor {key!r} was being read from it: "
            "something removed it during the restore"
        ) from None
    except EOFError:
        raise CorruptCheckpointError(
            f"{folder}: {file} is truncated; tensor {key!r} (bytes {start}-"
            f"{start + len(out)}) is missing. Restore an earlier step (see `unbroken ls`)."
        ) from None


def _verify(folder: str, key: str, chunk: Chunk, view: memoryview) -> None:
    verify_block(
        view,
        chunk.xxh3,
        f"{folder}: tensor {key!r} in {chunk.file} (bytes {chunk.start}-{chunk.end})",
        "; the file is damaged. Restore an earlier step (see `unbroken ls`).",
    )


# Blocks smaller than this are fetched together with their neighbours in one request:
# on object stores each request costs a round trip (tens of ms on some servers), and a
# model has hundreds of small tensors.
SMALL_BYTES = 1 << 20
GROUP_BYTES = 16 << 20


def read_many(
    storage: Storage, folder: str,
    items: Sequence[tuple[str, TensorEntry, Chunk, torch.Tensor]], threads: int,
    verify: bool = True,
) -> None:  # fmt: skip
    """Read whole chunks into ``out`` tensors (contiguous, CPU, the chunk's dtype and
    shape), verifying each unless ``verify=False``; runs of small neighbouring chunks go
    in one request."""
    ordered = sorted(items, key=lambda item: (item[2].file, item[2].start))
    jobs: list[list[tuple[str, TensorEntry, Chunk, torch.Tensor]]] = []
    for item in ordered:
        chunk = item[2]
        last = jobs[-1] if jobs else None
        if (
            last is not None
            and chunk.nbytes < SMALL_BYTES
            and last[-1][2].nbytes < SMALL_BYTES
            and last[-1][2].file == chunk.file
            and last[-1][2].end == chunk.start
            and chunk.end - last[0][2].start <= GROUP_BYTES
        ):
            last.append(item)
        else:
            jobs.append([item])

    def run(group: list[tuple[str, TensorEntry, Chunk, torch.Tensor]]) -> None:
        if len(group) == 1:
            key, entry, chunk, out = group[0]
            read_chunk(storage, folder, key, entry, chunk, out=out, verify=verify)
            return
        first = group[0][2]
        data = bytearray(group[-1][2].end - first.start)
        _read(storage, folder, group[0][0], first.file, first.start, memoryview(data))
        for key, _, chunk, out in group:
            view = byte_view(out)
            view[:] = data[chunk.start - first.start : chunk.end - first.start]
            if verify:
                _verify(folder, key, chunk, view)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for done in pool.map(run, jobs):
            del done


def fill(
    storage: Storage, folder: str, key: str, entry: TensorEntry, chunks: Sequence[Chunk],
    dest: torch.Tensor, offsets: Sequence[int],
) -> None:  # fmt: skip
    """Fill ``dest``, the region of the global tensor at ``offsets``, from ``chunks``:
    each chunk that overlaps it is read only as far as `read_region` needs."""
    direct = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == entry.torch_dtype
    covered = 0
    for chunk in chunks:
        if chunk.offsets == list(offsets) and chunk.shape == list(dest.shape):
            if direct:
                read_chunk(storage, folder, key, entry, chunk, out=dest)
            else:
                dest.copy_(read_chunk(storage, folder, key, entry, chunk))
            return
        region = overlap(offsets, dest.shape, chunk.offsets, chunk.shape)
        if region is None:
            continue
        src = read_region(storage, folder, key, entry, chunk, region)
        dst = dest
        for dim, (lo, hi) in enumerate(region):
            dst = dst.narrow(dim, lo - offsets[dim], hi - lo)
        dst.copy_(src)
        covered += math.prod(hi - lo for lo, hi in region)
    if covered != dest.numel():
        raise CheckpointError(
            f"{folder}: the checkpoint does not hold all of tensor {key!r} for the region at "
            f"{list(offsets)} of shape {list(dest.shape)}"
        )


def read_region(
    storage: Storage, folder: str, key: str, entry: TensorEntry, chunk: Chunk,
    region: Sequence[tuple[int, int]],
) -> torch.Tensor:  # fmt: skip
    """The part ``region`` (``[lo, hi)`` per dimension, global indices) of ``chunk``.

    A chunk with piece checksums is read from the first to the last piece holding a byte
    of the region (in C order everything in between, so a region cut along dim 0, as
    FSDP cuts, costs at most one extra piece at either end), and each piece is checked.
    A chunk without them (small, or from a version-1 checkpoint) is read and checked
    whole. Returns a strided view; every byte in it has passed its checksum."""
    rel = [(lo - o, hi - o) for (lo, hi), o in zip(region, chunk.offsets, strict=True)]
    if chunk.pieces is None or chunk.piece_bytes is None:
        data = read_chunk(storage, folder, key, entry, chunk)
        for dim, (lo, hi) in enumerate(rel):
            data = data.narrow(dim, lo, hi - lo)
        return data
    size = torch.empty((), dtype=entry.torch_dtype).element_size()
    strides = [math.prod(chunk.shape[dim + 1 :]) for dim in range(len(chunk.shape))]
    first = sum(lo * s for (lo, _), s in zip(rel, strides, strict=True))
    last = sum((hi - 1) * s for (_, hi), s in zip(rel, strides, strict=True))
    piece = chunk.piece_bytes
    lo_byte = first * size // piece * piece
    hi_byte = min(-(-(last + 1) * size // piece) * piece, chunk.nbytes)
    data = torch.empty((hi_byte - lo_byte) // size, dtype=entry.torch_dtype)
    view = byte_view(data)
    _read(storage, folder, key, chunk.file, chunk.start + lo_byte, view)
    for index in range(lo_byte // piece, -(-hi_byte // piece)):
        at = index * piece - lo_byte
        verify_block(
            view[at : at + piece],
            chunk.pieces[index],
            f"{folder}: tensor {key!r} in {chunk.file} (bytes {chunk.start + lo_byte + at}-"
            f"{chunk.start + min(lo_byte + at + piece, chunk.nbytes)}, piece {index} of the "
            f"block at {chunk.start}-{chunk.end})",
            "; the file is damaged. Restore an earlier step (see `unbroken ls`).",
        )
    shape = [hi - lo for lo, hi in rel]
    return data.as_strided(shape, strides, first - lo_byte // size)


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
