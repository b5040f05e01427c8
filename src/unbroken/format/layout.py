"""The on-storage format: step directories, shard files in safetensors layout, the manifest.

A checkpoint is a directory ``step-000001200/`` holding shard files
``r00000-000.safetensors`` (valid safetensors files, many tensors each) and one
``manifest.json``. The manifest is the commit: a directory without it does not exist.
See docs/format.md for the full description; `VERSION` is bumped on any change that an
older reader could misread.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.validate import WHOLE, Part, validate_manifest
from unbroken.job.gc_paused import building

if TYPE_CHECKING:
    import torch

FORMAT = "unbroken-checkpoint"
VERSION = 2  # 2: chunks over one piece carry a checksum per piece (see block_checksums)
MANIFEST = "manifest.json"
LATEST = "latest"  # {"step": N}: the newest committed step, moved only after its commit
INFO = "info.json"  # in a step's folder: when it was committed, its metric, DDP layouts
_STEP_RE = re.compile(r"^step-(\d{9,})$")
_COMPACT = json.JSONEncoder(separators=(",", ":"))  # as `Manifest.to_json` encodes


@functools.cache
def _tables() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype]]:
    """The format's dtype names, both ways: built on first use, so that reading a manifest
    (``unbroken ls``) never imports torch, which takes seconds."""
    import torch

    names: dict[torch.dtype, str] = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint64: "U64",
        torch.uint32: "U32",
        torch.uint16: "U16",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.complex64: "C64",
    }
    return names, {name: dtype for dtype, name in names.items()}


def __getattr__(name: str) -> Any:
    """``DTYPES`` (torch dtype -> name) and ``TORCH_DTYPES`` (name -> torch dtype)."""
    if name in ("DTYPES", "TORCH_DTYPES"):
        return _tables()[1 if name == "TORCH_DTYPES" else 0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def shard_file(rank: int, index: int) -> str:
    return f"r{rank:05d}-{index:03d}.safetensors"


def checksum(data: memoryview | Sequence[memoryview]) -> str:
    """xxh3-64 of ``data`` (or of its parts back to back) as 16 hex digits (~20 GiB/s
    here, so it never limits IO)."""
    if isinstance(data, memoryview):
        return xxhash.xxh3_64_hexdigest(data)
    digest = xxhash.xxh3_64()
    for part in data:
        digest.update(part)
    return digest.hexdigest()


# The checksum grain for partial reads. A rank that restores part of a stored block reads
# the pieces its part touches, whole, and checks each: at most one piece of extra bytes at
# either end of its part. 1 MiB is where a request to an object store stops being
# dominated by its round trip (see shards.SMALL_BYTES), so a finer grain would save no
# time, while the manifest grows by ~19 bytes of JSON per MiB stored (docs/format.md).
PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class Checksums:
    """A block's checksums as a manifest chunk stores them (its fields are `Chunk`'s):
    ``xxh3`` of the whole block and, for a block over one piece, ``pieces``: the xxh3 of
    each ``piece_bytes`` bytes in order (the last piece may be shorter)."""

    xxh3: str
    pieces: list[str] | None = None
    piece_bytes: int | None = None

    def fields(self) -> dict[str, Any]:
        """As keyword arguments of a `Chunk` (``dataclasses.asdict`` deep-copies: a save
        calls this for every block)."""
        return {"xxh3": self.xxh3, "pieces": self.pieces, "piece_bytes": self.piece_bytes}


def block_checksums(data: memoryview, piece_bytes: int = PIECE_BYTES) -> Checksums:
    """The checksums of a stored block: every writer of the format computes them here.

    >>> chunk = Chunk(offsets=..., shape=..., file=..., start=..., end=...,
    ...               **block_checksums(view).fields())
    """
    if len(data) <= piece_bytes:
        return Checksums(checksum(data))
    whole, pieces = xxhash.xxh3_64(), []
    for i in range(0, len(data), piece_bytes):  # one pass: each piece is hashed from cache
        piece = data[i : i + piece_bytes]
        pieces.append(checksum(piece))
        whole.update(piece)
    return Checksums(whole.hexdigest(), pieces, piece_bytes)


def verify_block(
    data: memoryview | Sequence[memoryview], expected: str, what: str, consequence: str = ""
) -> None:
    """Raise `CorruptCheckpointError` ("<what> fails its checksum<consequence>") unless
    ``data`` hashes to ``expected``: the one check every byte read or received passes."""
    if checksum(data) != expected:
        raise CorruptCheckpointError(f"{what} fails its checksum{consequence}")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _tables()[0][dtype]
    except KeyError:
        raise CheckpointError(f"tensors of dtype {dtype} cannot be checkpointed yet") from None


def torch_dtype(name: str, where: str) -> torch.dtype:
    try:
        return _tables()[1][name]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r}") from None


@dataclass(kw_only=True)
class Chunk:
    """One stored block of a tensor: the region ``offsets``/``shape`` of the global tensor,
    held in ``file`` at bytes ``[start, end)``. ``ranks`` is set only when ranks saved
    different values under the same key and region: it names the ranks each value is for.
    ``xxh3``, ``pieces`` and ``piece_bytes`` are the block's `Checksums`."""

    offsets: list[int]
    shape: list[int]
    file: str = ""
    start: int = 0
    end: int = 0
    xxh3: str = ""
    ranks: list[int] | None = None
    pieces: list[str] | None = None
    piece_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        """As the manifest stores it: the optional fields only when set."""
        out: dict[str, Any] = {
            "offsets": self.offsets, "shape": self.shape, "file": self.file,
            "start": self.start, "end": self.end, "xxh3": self.xxh3,
        }  # fmt: skip
        for name in ("ranks", "pieces", "piece_bytes"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        return out

    def to_text(self) -> str:
        """As `Manifest.to_json` writes it: a save's writers encode their own (`joined`)."""
        return _COMPACT.encode(self.to_dict())


@dataclass(kw_only=True)
class TensorEntry:
    dtype: str
    shape: list[int]
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _tables()[1][self.dtype]


@dataclass(kw_only=True)
class Manifest:
    step: int
    world_size: int
    created: float
    tensors: dict[str, TensorEntry]
    # Distinct per-rank JSON trees and, for each rank, the index of its tree: ranks of a
    # data-parallel job mostly hold the same non-tensor state, so it is stored once.
    objects: list[dict[str, Any]]
    rank_objects: list[int]
    files: dict[str, int]  # file name -> size in bytes
    version: int = VERSION

    def objects_for(self, rank: int) -> dict[str, Any]:
        return self.objects[self.rank_objects[rank]]

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    def to_json(self) -> bytes:
        # By hand, not dataclasses.asdict: its deep copy took most of a save's commit
        # (14 ms of 18 for a 180 KB manifest).
        with building():
            tensors = {
                key: {"dtype": e.dtype, "shape": e.shape, "chunks": [c.to_dict() for c in e.chunks]}
                for key, e in self.tensors.items()
            }
        body = {
            "format": FORMAT, "step": self.step, "world_size": self.world_size,
            "created": self.created, "tensors": tensors, "objects": self.objects,
            "rank_objects": self.rank_objects, "files": self.files, "version": self.version,
        }  # fmt: skip
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str, *, whole: bool = True) -> Manifest:
        """``data`` parsed and validated whole (`parse`); ``whole=False`` for one rank's
        snapshot, which holds only that rank's shards of a sharded tensor."""
        return cls.built(parse(data, where, whole=whole), where)

    @classmethod
    def built(cls, raw: dict[str, Any], where: str) -> Manifest:
        """The manifest of ``raw``, which `parse` checked: every part of it, in this
        process or on the ranks of a restore, one part each, none refused."""
        with building():  # tens of thousands of dicts and lists at scale
            try:
                tensors = {
                    key: TensorEntry(
                        dtype=e["dtype"], shape=e["shape"], chunks=[Chunk(**c) for c in e["chunks"]]
                    )
                    for key, e in raw["tensors"].items()
                }
                return cls(
                    step=raw["step"],
                    world_size=raw["world_size"],
                    created=raw["created"],
                    tensors=tensors,
                    objects=raw["objects"],
                    rank_objects=raw["rank_objects"],
                    files=raw["files"],
                    version=raw["version"],
                )
            except (KeyError, TypeError) as e:
                raise CorruptCheckpointError(f"{where} is missing or has a malformed {e}") from None


@dataclass(frozen=True, kw_only=True)
class Encoded:
    """A manifest encoded already (`joined`); `Directory.commit` takes it as it takes a
    `Manifest`."""

    step: int
    data: bytes

    def to_json(self) -> bytes:
        return self.data


def joined(manifest: Manifest, chunks: Mapping[str, list[str]]) -> Encoded:
    """``manifest`` with each tensor's chunks as their writers encoded them
    (`Chunk.to_text`), ``manifest.tensors`` giving the order and the tensors' dtype and
    shape: the bytes `Manifest.to_json` writes, without a `Chunk` per block (a save's
    manifest, on rank 0, of every block of the job)."""
    tensors = ",".join(
        f'{json.dumps(key)}:{{"dtype":{json.dumps(e.dtype)},'
        f'"shape":{_COMPACT.encode(e.shape)},"chunks":[{",".join(chunks[key])}]}}'
        for key, e in manifest.tensors.items()
    )
    m = manifest
    head = _COMPACT.encode({"format": FORMAT, "step": m.step, "world_size": m.world_size,
                            "created": m.created})  # fmt: skip
    tail = _COMPACT.encode({"objects": m.objects, "rank_objects": m.rank_objects,
                            "files": m.files, "version": m.version})  # fmt: skip
    text = f'{head[:-1]},"tensors":{{{tensors}}},{tail[1:]}'
    return Encoded(step=m.step, data=text.encode())


def parse(data: bytes, where: str, part: Part = WHOLE, *, whole: bool = True) -> dict[str, Any]:
    """A manifest's JSON, its header and ``part`` of the rest validated
    (`unbroken.format.validate`) before anything it names is read or allocated: a
    `CorruptCheckpointError` naming what is wrong, or a `CheckpointError` for a format
    newer than this reader's. `Manifest.built` makes the manifest once every part is
    checked."""
    with building():  # tens of thousands of dicts and lists at scale
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise CorruptCheckpointError(f"{where} is not valid JSON ({e!s:.200})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{where} is not an unbroken manifest")
        version = raw.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise CheckpointError(
                f"{where} has format version {version}, newer than this unbroken reads "
                f"(version {VERSION}); upgrade unbroken to restore it"
            )
        for key in validate_manifest(raw, where, part, whole=whole):
            for chunk in raw["tensors"][key]["chunks"]:
                _check_pieces(chunk, f"{where}: tensor {key!r}")
        return raw


def _check_pieces(chunk: dict[str, Any], where: str) -> None:
    """Pieces that do not tile the block exactly would leave bytes unverified."""
    pieces, size = chunk.get("pieces"), chunk.get("piece_bytes")
    if pieces is None and size is None:
        return
    start, end = chunk["start"], chunk["end"]  # validated
    if not (isinstance(size, int) and size > 0 and isinstance(pieces, list)) or len(pieces) != -(
        -(end - start) // size
    ):
        raise CorruptCheckpointError(
            f"{where}: the piece checksums of the block at {chunk['file']} bytes "
            f"{start}-{end} do not cover it"
        )


def safetensors_header(entries: list[tuple[str, torch.dtype, list[int], int]]) -> bytes:
    """The header of a safetensors file holding ``(name, dtype, shape, nbytes)`` in order:
    8-byte little-endian length, then JSON padded with spaces so the data starts 8-aligned."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "unbroken"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {
            "dtype": dtype_name(dtype),
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def nbytes_of(dtype: torch.dtype, shape: list[int]) -> int:
    return math.prod(shape) * dtype.itemsize
