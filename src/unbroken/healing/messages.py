"""What peers hand a heal, checked whole before anything in it is used or allocated, as
a manifest is (`unbroken.format.validate`): the rows every rank gathers for the plan,
the framing of the messages sent point to point, the live replica's description of its
replicated entries (`Meta`) and whether it fits this rank's state (`fits`), and the JSON
tree and tensor table of a step record.

A peer may be buggy, of another version, or hostile. The checks raise ValueError saying
what is wrong, which their callers turn into a `CheckpointError` naming the peer (or
raise that directly), so a heal never meets a KeyError or a RecursionError, and never
allocates more than this rank's own state bounds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from unbroken.errors import CheckpointError
from unbroken.format.layout import TORCH_DTYPES, checksum
from unbroken.format.validate import MAX_STEP, tensor_bytes

# The encoding's markers (`unbroken.state.capture`): a tensor placeholder, a tuple, a
# dict whose keys are not plain strings.
from unbroken.tree import ITEMS, TENSOR, TUPLE

MAX_DEPTH = 100  # a state tree's nesting (an optimizer's is 5 deep): decoding recurses
MAX_HELD = 64  # steps a row may say it holds for one rank (records keep 2)
MAX_ENTRIES = 10_000  # top-level entries of a state, in a record's digests
STATE_FACTOR = 8  # optimizer state bytes per parameter byte: Adam's two fp32 moments of bf16
SCALAR_BYTES = 64  # ... and per parameter, for its scalars (a step count)
_XXH3 = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Spec:
    """One tensor a peer describes: checked to be a known dtype and a sane shape."""

    key: str
    dtype: torch.dtype
    shape: list[int]
    nbytes: int
    xxh3: str = ""  # the live replica's checksum of its bytes; a record's has none


@dataclass(frozen=True)
class Meta:
    """A live replica's description of its replicated entries: their JSON ``tree``, each
    tensor's `Spec`, and the digest of that table the replicas compared."""

    tree: dict[str, Any]
    tensors: list[Spec]
    digest: str
    source: int  # the rank that sent it
    step: int  # the step it heals


def check_tree(tree: Any, keys: Collection[str]) -> None:
    """ValueError unless ``tree`` is an object of encoded entries (`unbroken.state`) at
    most `MAX_DEPTH` deep, whose tensor placeholders name exactly ``keys``. Iterative:
    a deep tree is refused, never recursed into."""
    if not isinstance(tree, dict):
        raise ValueError("its tree is not an object")
    used: set[str] = set()
    stack: list[tuple[Any, int]] = [(v, 1) for v in tree.values()]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"its tree nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, dict):
            stack.extend((v, depth + 1) for v in _children(value, keys, used))
    if used != set(keys):
        missing = sorted(set(keys) - used)[:5]
        raise ValueError(f"its tree places no tensor {missing} of its table")


def _children(value: dict[str, Any], keys: Collection[str], used: set[str]) -> list[Any]:
    """The values inside one encoded object, checked to be of the encoding's forms."""
    if TENSOR in value:
        key = value[TENSOR]
        if len(value) != 1 or not isinstance(key, str) or key not in keys:
            raise ValueError(f"its tree has a placeholder {value!r:.80} for no tensor it lists")
        used.add(key)
        return []
    if TUPLE in value:
        if len(value) != 1 or not isinstance(value[TUPLE], list):
            raise ValueError(f"its tree has a malformed tuple {value!r:.80}")
        return list(value[TUPLE])
    if ITEMS in value:
        items = value[ITEMS]
        if (
            len(value) != 1
            or not isinstance(items, list)
            or not all(
                isinstance(p, list)
                and len(p) == 2
                and (p[0] is None or type(p[0]) in (str, int, bool))
                for p in items
            )
        ):
            raise ValueError(f"its tree has a malformed mapping {value!r:.80}")
        return [v for _, v in items]
    return list(value.values())


def check_table(raw: Any, checksums: bool) -> list[Spec]:
    """The tensor table ``[[key, dtype, shape(, xxh3)], ...]`` as `Spec`\\ s; ValueError
    unless every entry names a distinct key, a known dtype, a sane shape (and, where
    ``checksums``, an xxh3)."""
    width = 4 if checksums else 3
    if not isinstance(raw, list):
        raise ValueError("its tensor table is not a list")
    specs, seen = [], set()
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == width and isinstance(entry[0], str)):
            raise ValueError(f"its tensor entry {entry!r:.80} is not {width} fields and a name")
        key = entry[0]
        if key in seen:
            raise ValueError(f"it lists tensor {key!r:.100} twice")
        seen.add(key)
        nbytes = tensor_bytes(entry[1], entry[2], f"tensor {key!r:.100}")
        xxh3 = entry[3] if checksums else ""
        if checksums and not (isinstance(xxh3, str) and _XXH3.fullmatch(xxh3)):
            raise ValueError(f"tensor {key!r:.100} has no valid checksum")
        specs.append(Spec(key, TORCH_DTYPES[entry[1]], list(entry[2]), nbytes, xxh3))
    return specs


def meta(data: bytes, source: int, step: int, digest: str) -> Meta:
    """The `Meta` rank ``source`` sent for the heal of ``step``, checked whole, and
    against ``digest`` (what ``source`` told every rank when the replicas compared
    theirs). `CheckpointError` naming the rank and what is wrong."""
    try:
        raw = json_object(data)
        specs = check_table(raw.get("tensors"), checksums=True)
        check_tree(raw.get("tree"), [s.key for s in specs])
        # The source's digest is of its table exactly as it wrote it (`live._meta`).
        if checksum(memoryview(json.dumps(raw["tensors"]).encode())) != digest:
            raise ValueError("its tensor table is not the one its replicas agreed on")
    except ValueError as e:
        raise CheckpointError(
            f"rank {source} sent a malformed description of its replicated "
            f"state for the heal of step {step}: {str(e)[:300]}. Every rank must run the "
            "same unbroken and model code; restart the job to restore from a snapshot"
        ) from None
    return Meta(raw["tree"], specs, digest, source, step)


def json_object(data: bytes) -> dict[str, Any]:
    """A JSON object; ValueError for anything else (bad bytes, deep nesting)."""
    try:
        raw = json.loads(data)
    except RecursionError:  # UnicodeDecodeError is a ValueError already
        raise ValueError("it nests too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError("it is not a JSON object")
    return raw


def rows(table: list[Any], world: int) -> list[dict[str, Any]]:
    """The plan's gathered rows (``{"live", "held", "peers"}`` of each rank), checked:
    every rank sees the same rows, so every rank raises the same `CheckpointError`."""
    for rank, row in enumerate(table):
        try:
            if not isinstance(row, dict):
                raise ValueError("it is not an object")
            _step_or_none(row.get("live"), "live")
            held = _by_rank(row.get("held"), world, "held")
            for owner, steps in held.items():
                if not isinstance(steps, list) or len(steps) > MAX_HELD:
                    raise ValueError(f"held steps of rank {owner} are not a short list")
                for step in steps:
                    _step_or_none(step, "a held step", optional=False)
            _ranks_or_none(row.get("peers"), world)
            _flight(row.get("flight"), world)
        except ValueError as e:
            raise _malformed(rank, "plan row", e) from None
    return table


def _flight(value: Any, world: int) -> None:
    """A row's step in flight (`unbroken.healing.inflight.row`), or None."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError("flight is not an object")
    _step_or_none(value.get("after"), "flight's after", optional=False)
    _digests(value.get("post"))
    if value.get("pre") is not None:
        _digests(value["pre"])
    for found in _by_rank(value.get("held"), world, "flight's held").values():
        _digests(found)
    following = value.get("next")
    if following is None:
        return
    if not isinstance(following, dict):
        raise ValueError("flight's next is not an object")
    if following.get("own") is not None:
        _digests(following["own"])
    for found in _by_rank(following.get("held"), world, "flight's next held").values():
        _digests(found)


def _by_rank(value: Any, world: int, what: str) -> dict[str, Any]:
    """``value`` if it is an object of at most one entry per rank, keyed by rank."""
    if not isinstance(value, dict) or len(value) > world:
        raise ValueError(f"{what} is not an object of at most one entry per rank")
    for owner in value:
        if not (isinstance(owner, str) and owner.isascii() and owner.isdigit()
                and int(owner) < world):  # fmt: skip
            raise ValueError(f"{what} names no rank: {owner!r:.40}")
    return value


def _digests(value: Any) -> None:
    """A record's ``{entry name: xxh3}``."""
    if not (
        isinstance(value, dict)
        and len(value) <= MAX_ENTRIES
        and all(isinstance(k, str) and isinstance(v, str) and _XXH3.fullmatch(v)
                for k, v in value.items())
    ):  # fmt: skip
        raise ValueError(f"record digests are not names and checksums: {value!r:.60}")


def digests(table: list[Any], world: int) -> list[tuple[str, list[int] | None] | None]:
    """The gathered ``[digest, peers]`` of each live source (None elsewhere), checked."""
    for rank, row in enumerate(table):
        try:
            if row is not None:
                if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)):
                    raise ValueError("it is not [digest, peers]")
                if not _XXH3.fullmatch(row[0]):
                    raise ValueError(f"its digest {row[0]!r:.40} is not an xxh3")
                _ranks_or_none(row[1], world)
        except ValueError as e:
            raise _malformed(rank, "replica digest", e) from None
    return [None if row is None else (row[0], row[1]) for row in table]


def _step_or_none(value: Any, what: str, optional: bool = True) -> None:
    if not (optional and value is None) and not (type(value) is int and 0 <= value <= MAX_STEP):
        raise ValueError(f"{what} is not a step: {value!r:.40}")


def _ranks_or_none(value: Any, world: int) -> None:
    if value is not None and not (
        isinstance(value, list)
        and len(value) <= world
        and all(type(r) is int and 0 <= r < world for r in value)
    ):
        raise ValueError(f"peers is not a list of ranks: {value!r:.60}")


def _malformed(rank: int, what: str, e: ValueError) -> CheckpointError:
    return CheckpointError(
        f"rank {rank} sent a malformed heal {what} ({str(e)[:200]}); every rank must run "
        "the same unbroken version: not healing, restart the job to restore from a snapshot"
    )


def frame(parts: list[bytes]) -> bytes:
    """One message of ``parts``, each after its length."""
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def unframe(data: bytes, count: int, sender: int) -> list[bytes]:
    """The ``count`` parts of a framed message from rank ``sender``, or `CheckpointError`."""
    parts: list[bytes] = []
    at = 0
    while at + 8 <= len(data) and len(parts) < count:
        n = int.from_bytes(data[at : at + 8], "little")
        parts.append(data[at + 8 : at + 8 + n])
        at += 8 + n
    if len(parts) != count or at != len(data):
        raise CheckpointError(
            f"rank {sender} sent a heal message that is not {count} whole parts "
            f"({len(data)} bytes): every rank must run the same unbroken version"
        )
    return parts


def fits(state: Mapping[str, Any], current: Mapping[str, torch.Tensor], meta: Meta) -> None:
    """`CheckpointError` unless what ``meta`` describes fits this rank's state before a
    byte is allocated: a replacement builds the same model, so each module's tensors are
    the ones it holds; only optimizer state may be missing here (a fresh optimizer has
    none), and its size is bounded by the parameters it is the state of."""
    described = {spec.key for spec in meta.tensors}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            ours = {k for k in current if k.split("/", 1)[0] == name}
            theirs = {k for k in described if k.split("/", 1)[0] == name}
            if ours != theirs:
                raise CheckpointError(
                    f"module {name!r} differs from its live replica on rank {meta.source} "
                    f"at step {meta.step}: tensors {sorted(ours ^ theirs)[:5]} are on one "
                    "side only; build the same model on every rank"
                )
    extra: dict[str, int] = {}
    for spec in meta.tensors:
        if spec.key not in current:
            name = spec.key.split("/", 1)[0]
            extra[name] = extra.get(name, 0) + spec.nbytes
    for name, nbytes in extra.items():
        optim = state.get(name)
        params = [] if not isinstance(optim, Optimizer) else optim.param_groups
        budget = sum(
            STATE_FACTOR * _local_bytes(p) + SCALAR_BYTES for g in params for p in g["params"]
        )
        if nbytes > budget:
            raise CheckpointError(
                f"the live replica on rank {meta.source} describes {nbytes} bytes of state "
                f"at step {meta.step} for entry {name!r} that this rank lacks, more than "
                f"its parameters can need ({budget}): not allocated. Build the same model "
                "and optimizer on every rank"
            )


def _local_bytes(p: torch.Tensor) -> int:
    """The bytes this rank holds of parameter ``p`` (a DTensor's local part)."""
    held = p.to_local() if isinstance(p, DTensor) else p
    return held.numel() * held.element_size()
