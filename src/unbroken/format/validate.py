"""Validation of a parsed manifest, before anything it names is read or allocated.

A manifest may come from an attacker (a copied checkpoint, a shared bucket). Every field is
checked here against the format's schema (docs/format.md, "Validation"): types, bounds,
known dtypes, chunk regions inside their tensor, byte ranges inside their listed file and
equal to the block's size, no partly overlapping ranges, plain file names and indexes that
point somewhere. Anything else raises `CorruptCheckpointError` naming the field, so restore
never meets a KeyError, an IndexError or a terabyte allocation later.

The checks are hand-written rather than a JSON Schema: the cross-field rules (a range
inside its file, a region inside its tensor, no overlap) are not expressible in one, and
one pass over the chunks is cheap (measured: ~0.3 s for 100k chunks, see
tests/test_hostile.py::test_validation_is_linear_and_as_cheap_as_parsing).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from unbroken.errors import CorruptCheckpointError

MAX_WORLD = 1 << 20  # ranks
MAX_STEP = 1 << 62
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 50  # one tensor: ~1 PiB of bytes, far past any real model
MAX_FILE_BYTES = 1 << 50
MAX_OBJECTS = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_HEX = re.compile(r"^[0-9a-f]{0,16}$")
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
    "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8,
}  # fmt: skip


def _fail(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the manifest is damaged or not trusted")


def _int(value: Any, lo: int, hi: int, where: str, name: str) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(where, f"{name} must be an integer in [{lo}, {hi}], not {value!r:.60}")
    return value


def _ints(value: Any, lo: int, hi: int, where: str, name: str, length: int | None) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise _fail(where, f"{name} must be a list of at most {MAX_NDIM} integers")
    if length is not None and len(value) != length:
        raise _fail(where, f"{name} has {len(value)} dimensions, not {length}")
    return [_int(v, lo, hi, where, name) for v in value]


def file_name(name: Any, where: str) -> str:
    """A file name a manifest may name: plain, inside the step directory (no ``..``, no
    separators, not absolute, no leading dot)."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise _fail(where, f"file name {name!r:.80} is not a plain file name")
    return name


Part = tuple[int, int]  # (k, parts): the k-th of ``parts`` shares of a manifest's checks
WHOLE: Part = (0, 1)


def validate_manifest(
    raw: dict[str, Any], where: str, part: Part = WHOLE, *, whole: bool = True
) -> list[str]:
    """Raise `CorruptCheckpointError` unless ``raw`` (parsed JSON) is a well-formed manifest
    as far as ``part`` goes; returns the keys of the tensors it checked. ``whole=False``:
    one rank's snapshot, whose blocks of a sharded tensor cover only that rank's shards.

    The header (step, world, files, objects) is checked whole by every part; the tensors
    are split in ``parts`` runs of about as many chunks each, and the no-overlap rule
    by file. The ``parts`` parts together check exactly what `WHOLE` checks: the ranks
    of a restore check one part each and exchange their verdicts (docs/scaling.md)."""
    _int(raw.get("step"), 0, MAX_STEP, where, "step")
    world = _int(raw.get("world_size"), 1, MAX_WORLD, where, "world_size")
    if type(raw.get("created")) not in (int, float):
        raise _fail(where, "created must be a number")
    files = raw.get("files")
    if not isinstance(files, dict):
        raise _fail(where, "files must be an object")
    for name, size in files.items():
        _int(size, 0, MAX_FILE_BYTES, where, f"the size of file {file_name(name, where)!r}")
    objects, rank_objects = raw.get("objects"), raw.get("rank_objects")
    if not isinstance(objects, list) or not 0 < len(objects) <= min(MAX_OBJECTS, world):
        raise _fail(where, f"objects must be a list of 1 to world_size ({world}) trees")
    if not all(isinstance(o, dict) for o in objects):
        raise _fail(where, "every entry of objects must be an object")
    if not isinstance(rank_objects, list) or len(rank_objects) != world:
        raise _fail(where, f"rank_objects must list one index per rank ({world})")
    for rank, index in enumerate(rank_objects):
        _int(index, 0, len(objects) - 1, where, f"rank_objects[{rank}]")
    tensors = raw.get("tensors")
    if not isinstance(tensors, dict):
        raise _fail(where, "tensors must be an object")
    mine = share(tensors, part)
    for key in mine:
        _tensor(tensors[key], files, world, _where(where, key), whole)
    k, parts = part
    ours = {name for i, name in enumerate(files) if i % parts == k}
    for name, spans in _spans(tensors, ours).items():
        _no_overlap(name, spans, where)
    return mine


def _where(where: str, key: str) -> str:
    return f"{where}: tensor {key!r:.200}"


def share(tensors: dict[str, Any], part: Part) -> list[str]:
    """The keys of the ``k``-th of ``parts`` runs of tensors, cut where the count of
    chunks before a tensor crosses a multiple of total / parts (a malformed entry
    counts one)."""
    k, parts = part
    if parts == 1:
        return list(tensors)
    sizes = [
        len(c) if type(e) is dict and type(c := e.get("chunks")) is list else 1
        for e in tensors.values()
    ]
    total, before, mine = max(1, sum(sizes)), 0, []
    for key, size in zip(tensors, sizes, strict=True):
        if before * parts // total == k:
            mine.append(key)
        before += size
    return mine


def _spans(tensors: dict[str, Any], files: set[str]) -> dict[str, list[tuple[int, int, str]]]:
    """The byte ranges every chunk claims in ``files``: ``(start, end, key)``. Every
    tensor is looked at, those another part checks too, so what does not look like a
    range is passed over here (its own part refuses it)."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for key, entry in tensors.items():
        chunks = entry.get("chunks") if type(entry) is dict else None
        for c in chunks if type(chunks) is list else ():
            if type(c) is dict and (name := c.get("file")) in files:
                start, end = c.get("start"), c.get("end")
                if type(start) is int and type(end) is int:
                    ranges.setdefault(name, []).append((start, end, key))
    return ranges


def _tensor(entry: Any, files: dict[str, int], world: int, where: str, whole: bool) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("chunks"), list):
        raise _fail(where, "must be an object with dtype, shape and chunks")
    dtype = entry.get("dtype")
    itemsize = _ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise _fail(where, f"unknown dtype {entry.get('dtype')!r:.40}")
    shape = _ints(entry.get("shape"), 0, MAX_ELEMENTS, where, "shape", None)
    if math.prod(shape) > MAX_ELEMENTS:
        raise _fail(where, f"shape {shape} is absurdly large")
    covered, seen = 0, set()
    for chunk in entry["chunks"]:
        if not isinstance(chunk, dict):
            raise _fail(where, "every chunk must be an object")
        _chunk(chunk, shape, itemsize, files, world, where)
        span = (chunk["file"], chunk["start"], chunk["end"])
        if span in seen and chunk["end"] > chunk["start"]:
            raise _fail(where, f"two blocks claim bytes {span[1]}-{span[2]} of {span[0]}")
        seen.add(span)
        covered += math.prod(chunk["shape"])
    # Blocks cover the tensor, each from its own bytes: what a restore allocates for a
    # tensor the live state lacks is bounded by bytes that exist (sources check sizes).
    if whole and covered < math.prod(shape):
        raise _fail(where, f"its blocks do not cover its shape {shape}")


_CHUNK_FIELDS = frozenset(
    {"offsets", "shape", "file", "start", "end", "xxh3", "ranks", "pieces", "piece_bytes"}
)


def _chunk(
    chunk: dict[str, Any], shape: list[int], itemsize: int, files: dict[str, int], world: int,
    where: str,
) -> None:  # fmt: skip
    """Check one block. The common, valid case is checked in one expression (a manifest
    of 100,000 blocks is validated in about the time ``json.loads`` took to parse it); a
    block it does not pass is checked field by field, which names what is wrong."""
    offsets, size, name = chunk.get("offsets"), chunk.get("shape"), chunk.get("file")
    start, end, xxh3 = chunk.get("start"), chunk.get("end"), chunk.get("xxh3")
    if not (
        type(offsets) is list
        and type(size) is list
        and len(offsets) == len(size) == len(shape)
        and all(
            type(o) is int and type(n) is int and o >= 0 and n >= 0 and o + n <= g
            for o, n, g in zip(offsets, size, shape, strict=False)
        )
        and type(name) is str
        and name in files  # listed, so already checked to be a plain name
        and type(start) is int
        and type(end) is int
        and 0 <= start <= end <= files[name]
        and end - start == math.prod(size) * itemsize
        and type(xxh3) is str
        and _HEX.match(xxh3)
        and "ranks" not in chunk
        and "pieces" not in chunk
        and chunk.keys() <= _CHUNK_FIELDS
    ):
        _chunk_fields(chunk, shape, itemsize, files, world, where)


def _chunk_fields(
    chunk: dict[str, Any], shape: list[int], itemsize: int, files: dict[str, int], world: int,
    where: str,
) -> None:  # fmt: skip
    ndim = len(shape)
    offsets = _ints(chunk.get("offsets"), 0, MAX_ELEMENTS, where, "chunk offsets", ndim)
    size = _ints(chunk.get("shape"), 0, MAX_ELEMENTS, where, "chunk shape", ndim)
    if any(o + s > g for o, s, g in zip(offsets, size, shape, strict=True)):
        raise _fail(where, f"chunk at {offsets} of shape {size} lies outside shape {shape}")
    name = file_name(chunk.get("file"), where)
    if name not in files:
        raise _fail(where, f"chunk names file {name!r}, which files does not list")
    start = _int(chunk.get("start"), 0, files[name], where, f"start in {name}")
    end = _int(chunk.get("end"), start, files[name], where, f"end in {name} (start {start})")
    if end - start != math.prod(size) * itemsize:
        raise _fail(where, f"bytes {start}-{end} of {name} do not hold a {size} block")
    if not isinstance(chunk.get("xxh3"), str) or not _HEX.match(chunk["xxh3"]):
        raise _fail(where, f"the block at {name} bytes {start}-{end} has no valid checksum")
    ranks = chunk.get("ranks")
    if ranks is not None:
        if not isinstance(ranks, list) or not ranks or len(ranks) > world:
            raise _fail(where, "chunk ranks must list 1 to world_size ranks")
        for rank in ranks:
            _int(rank, 0, world - 1, where, "chunk rank")
    pieces = chunk.get("pieces")
    if pieces is not None and not (
        isinstance(pieces, list) and all(isinstance(p, str) and _HEX.match(p) for p in pieces)
    ):
        raise _fail(where, f"the piece checksums of {name} bytes {start}-{end} are malformed")
    unknown = chunk.keys() - _CHUNK_FIELDS
    if unknown:
        raise _fail(where, f"chunk has unknown fields {sorted(unknown)[:5]}")


def _no_overlap(name: str, spans: list[tuple[int, int, str]], where: str) -> None:
    """Blocks may share one range exactly (a deduplicated replicated block), never in part."""
    spans.sort()
    for (s0, e0, _), (s1, e1, key) in itertools.pairwise(spans):
        if s1 < e0 and (s0, e0) != (s1, e1):
            raise _fail(_where(where, key), f"bytes {s1}-{e1} of {name} overlap bytes {s0}-{e0}")


def stored_enough(key: str, dtype: str, shape: list[int], chunks: list[Any], where: str) -> None:
    """Refuse to allocate a tensor the live state lacks unless the checkpoint stores at least
    its bytes: the allocation is then bounded by files whose sizes storage confirmed, never
    by a shape an attacker wrote."""
    stored = sum(e - s for _, s, e in {(c.file, c.start, c.end) for c in chunks})
    if math.prod(shape) * _ITEMSIZE[dtype] > stored:
        raise _fail(
            f"{where}: tensor {key!r:.200}",
            f"shape {shape} needs more bytes than its {stored} stored ones; not allocated",
        )


def tensor_bytes(dtype: Any, shape: Any, what: str) -> int:
    """The bytes of a tensor of ``dtype`` (a format dtype name, ``"F32"``) and ``shape``,
    for a description other processes send (a heal's peer, a step record). ValueError
    naming ``what`` unless the dtype is known and the shape a list of at most `MAX_NDIM`
    non-negative integers of at most `MAX_ELEMENTS` elements in all: checked before
    anything is allocated for it."""
    itemsize = _ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise ValueError(f"{what} has an unknown dtype {dtype!r:.40}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM) or not all(
        type(n) is int and 0 <= n <= MAX_ELEMENTS for n in shape
    ):
        raise ValueError(f"{what} has an impossible shape {shape!r:.80}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f"{what} has an absurdly large shape {shape}")
    return math.prod(shape) * itemsize


def _small_json(data: bytes, what: str) -> dict[str, Any]:
    """A parsed JSON object; ValueError for anything else (bad bytes, deep nesting)."""
    try:
        raw = json.loads(data)
    except RecursionError:  # UnicodeDecodeError is a ValueError already
        raise ValueError(f"{what} nests too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is not a JSON object")
    return raw


def latest_step(data: bytes) -> int:
    """The step a ``latest`` pointer (``{"step": N}``) names. ValueError if it is not a
    well-formed pointer: its callers then list the steps instead."""
    step = _small_json(data, "the latest pointer").get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ValueError(f"the latest pointer names no step ({step!r:.40})")
    return step


def info_fields(data: bytes) -> tuple[float, float | None]:
    """``(created, metric)`` from a step's info file: a finite time and a number or none
    (a diverged run's NaN loss is a metric). ValueError if malformed: its callers then
    read the manifest's time."""
    raw = _small_json(data, "the info file")
    created: Any = raw.get("created")
    metric: Any = raw.get("metric")
    if type(created) not in (int, float) or not math.isfinite(created):
        raise ValueError(f"the info file has no valid time ({created!r:.40})")
    if metric is not None and type(metric) not in (int, float):
        raise ValueError(f"the info file has no valid metric ({metric!r:.40})")
    return float(created), metric


def snapshot_description(data: bytes) -> tuple[str, int, bytes]:
    """``(job, rank, manifest JSON)`` from a shared-memory slot's description
    (``slot-N.json``). ValueError if malformed: the slot then does not count. The
    manifest itself is validated by `Manifest.from_json`, as any manifest is."""
    raw = _small_json(data, "the snapshot description")
    job, rank, manifest = raw.get("job"), raw.get("rank"), raw.get("manifest")
    if not (isinstance(job, str) and type(rank) is int and isinstance(manifest, str)):
        raise ValueError("the snapshot description lacks its job, rank or manifest")
    return job, rank, manifest.encode()


MAX_HEADER = 100 << 20  # the safetensors reference reader's own limit


def header_ranges(data: bytes, size: int, where: str) -> set[tuple[int, int]]:
    """The absolute byte ranges ``[start, end)`` a safetensors header lists, given the
    header's bytes (its 8-byte length, then its JSON) and the file's ``size``.
    `CorruptCheckpointError` naming ``where`` unless it is a well-formed header whose every
    tensor lies inside the file and holds exactly its dtype and shape's bytes."""
    try:
        return _header_ranges(data, size, where)
    except CorruptCheckpointError as e:
        tail = "; the manifest is damaged or not trusted"
        raise CorruptCheckpointError(
            f"{str(e).removesuffix(tail)}; the shard's safetensors header is damaged (restore "
            "does not read it, but other tools do): re-save or export the step"
        ) from None


def _header_ranges(data: bytes, size: int, where: str) -> set[tuple[int, int]]:
    if len(data) < 8:
        raise _fail(where, "the safetensors header is shorter than its length field")
    n = int.from_bytes(data[:8], "little")
    if n > min(MAX_HEADER, size - 8) or len(data) < 8 + n:
        raise _fail(where, f"the safetensors header claims {n} bytes")
    try:
        raw = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError):
        raise _fail(where, "the safetensors header is not valid JSON") from None
    if not isinstance(raw, dict):
        raise _fail(where, "the safetensors header is not a JSON object")
    ranges = set()
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        what = f"safetensors entry {name!r:.100}"
        if not isinstance(entry, dict) or entry.get("dtype") not in _ITEMSIZE:
            raise _fail(where, f"{what} has no known dtype")
        shape = _ints(entry.get("shape"), 0, MAX_ELEMENTS, where, f"{what} shape", None)
        start, end = _ints(entry.get("data_offsets"), 0, size, where, f"{what} offsets", 2)
        if (
            not start <= end <= size - 8 - n
            or end - start != math.prod(shape) * _ITEMSIZE[entry["dtype"]]
        ):
            raise _fail(where, f"{what} bytes {start}-{end} do not hold its shape {shape}")
        ranges.add((8 + n + start, 8 + n + end))
    return ranges
