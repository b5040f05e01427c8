"""Per-step records: the part of a rank's state that its data-parallel replicas do not
share, kept in process memory on the rank itself and on its record partners.

`Checkpointer.step` makes one each step. Modules and optimizers are replicated across
data-parallel ranks, so a record leaves them out, keeping only a *fingerprint* of them
(a few sampled elements of every tensor: enough to notice that the state moved past the
recorded step). Everything else in the state (`Progress`, `RNGState`, schedulers, plain
values, tensors outside modules and optimizers) is in the record whole: it is small,
and it is what a replacement cannot get from a healthy replica.

Records live in this module's registry, in process memory, so that they survive the
in-process generations of ``unbroken run --in-process`` (each generation builds a new
Checkpointer). Each rank keeps its own two newest and the two newest of each rank it is
a partner of. Encoded records are JSON plus raw tensor bytes with an xxh3 checksum:
nothing received runs code.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from unbroken.errors import CheckpointError
from unbroken.format.layout import checksum, dtype_name, torch_dtype
from unbroken.format.shards import byte_view
from unbroken.format.validate import MAX_STEP, MAX_WORLD
from unbroken.healing import messages
from unbroken.job.comm import Comm
from unbroken.state import capture
from unbroken.tree import tensor_keys

KEEP = 2  # records kept per rank: the newest may be half-sent when a peer dies
SAMPLES = 16  # elements sampled per tensor for a fingerprint


def replicated(value: object) -> bool:
    """Whether a state entry is one data-parallel replicas share (modules, optimizers)."""
    return isinstance(value, nn.Module | Optimizer)


@dataclass(frozen=True)
class Record:
    """One rank's per-rank state at one step, encoded (``data``) and described
    (``header``: step, rank, JSON tree, tensor table, fingerprint, layouts...)."""

    header: dict[str, Any]
    data: bytes

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def rank(self) -> int:
        return int(self.header["rank"])

    @property
    def after(self) -> int | None:
        """The step of the record this rank made (or restored) before this one."""
        after = self.header.get("after")
        return after if type(after) is int else None

    @classmethod
    def make(
        cls,
        step: int,
        rank: int,
        state: Mapping[str, Any],
        *,
        fingerprinted: bool = True,
        **extra: Any,
    ) -> Record:
        """The record of ``state`` at ``step``; ``extra`` header fields (``after``: the
        step of the record before it; ``layouts``...). Its ``digests`` name each entry's
        value, for `unbroken.healing.inflight` to compare across ranks. A record never
        checked against live state (a prepared one) skips the fingerprint."""
        tensors, tree = capture({k: v for k, v in state.items() if not replicated(v)})
        table, parts = [], {}
        for key, t in tensors.items():
            cpu = t.detach().to("cpu").contiguous()
            table.append([key, dtype_name(cpu.dtype), list(cpu.shape)])
            parts[key] = bytes(byte_view(cpu))
        payload = b"".join(parts.values())
        digests = {
            name: checksum(memoryview(json.dumps(value, sort_keys=True).encode()
                                      + b"".join(parts[k] for k in tensor_keys(value))))
            for name, value in tree.items()
        }  # fmt: skip
        header = {
            "step": step, "rank": rank, "tree": tree, "tensors": table, "digests": digests,
            "fingerprint": fingerprint(state) if fingerprinted else "",
            "xxh3": checksum(memoryview(payload)), **extra,
        }  # fmt: skip
        text = json.dumps(header).encode()
        return cls(header, struct.pack("<Q", len(text)) + text + payload)

    @classmethod
    def decode(cls, data: bytes, where: str) -> Record:
        """A received record, checked whole before anything in it is used or allocated:
        `CheckpointError` naming ``where`` if it is malformed or fails its checksum."""
        try:
            (size,) = struct.unpack_from("<Q", data)
            if size > len(data) - 8:
                raise ValueError(f"a header of {size} bytes in {len(data)}")
            header = json.loads(data[8 : 8 + size])
            payload = memoryview(data)[8 + size :]
            _check_header(header, len(payload))
            ok = checksum(payload) == header["xxh3"]
        except (struct.error, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(
                f"the step record from {where} is not readable ({str(e)[:300]}): it cannot "
                "heal; every rank must run the same unbroken version"
            ) from e
        if not ok:
            raise CheckpointError(f"the step record from {where} fails its checksum")
        return cls(header, data)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's per-rank tensors, new CPU tensors."""
        (size,) = struct.unpack_from("<Q", self.data)
        offset, found = 8 + size, {}
        for key, dtype, shape in self.header["tensors"]:
            t = torch.empty(shape, dtype=torch_dtype(dtype, f"step record: {key}"))
            n = t.numel() * t.element_size()
            byte_view(t)[:] = self.data[offset : offset + n]
            found[key], offset = t, offset + n
        return found


def _check_header(header: Any, payload: int) -> None:
    """Raise ValueError unless ``header`` has the fields a record needs, of their types;
    its tree is one `decode` can walk (`messages.check_tree`: not too deep, placeholders
    for exactly the tensors it lists); and its tensor table describes exactly the
    ``payload`` bytes that follow it (so decoding never allocates more than was
    received). Its DDP layouts are checked where they are used (`Stepper`): a bad one
    is ignored, never a reason to refuse the record."""
    fields = {"step": int, "rank": int, "tree": dict, "tensors": list, "fingerprint": str,
              "xxh3": str}  # fmt: skip
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    for name, kind in fields.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise ValueError(f"field {name!r} is missing or not a {kind.__name__}")
    if not (0 <= header["step"] <= MAX_STEP and 0 <= header["rank"] <= MAX_WORLD):
        raise ValueError(f"step {header['step']} or rank {header['rank']} is out of range")
    specs = messages.check_table(header["tensors"], checksums=False)
    total = sum(spec.nbytes for spec in specs)
    if total != payload:
        raise ValueError(f"its tensors need {total} bytes, it carries {payload}")
    messages.check_tree(header["tree"], [spec.key for spec in specs])


def fingerprint(state: Mapping[str, Any]) -> str:
    """A cheap digest of the replicated entries: names, shapes, dtypes and a few evenly
    spaced elements of every tensor (an optimizer step changes nearly all of them). It
    runs every step: the names and the sample views are made once for a set of tensors
    and kept while each is the same object, at the same address, in the same layout."""
    found = [(k, t, _local(t)) for k, t in _replicated_tensors(state)]
    where = tuple((k, id(t), x.data_ptr(), x.shape, x.stride(), x.dtype) for k, t, x in found)
    names, samples = _sampled.get(where) or _sample(where, found)
    data = b"".join(bytes(byte_view(torch.cat(s).cpu())) for s in samples)
    return checksum(memoryview(names + data))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# The views of the newest set of tensors only (a view keeps its storage alive).
_sampled: dict[tuple[Any, ...], tuple[bytes, list[list[torch.Tensor]]]] = {}


def _sample(
    where: tuple[Any, ...], found: list[tuple[str, torch.Tensor, torch.Tensor]]
) -> tuple[bytes, list[list[torch.Tensor]]]:
    names: list[str] = []
    # One copy per dtype and device, not one per tensor.
    samples: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for key, t, local in found:
        local = local.detach()
        n = local.numel()
        stride = max(1, n // SAMPLES)
        names.append(f"{key}:{dtype_name(t.dtype)}:{list(t.shape)}")
        if local.is_contiguous():  # the samples as one view
            sample = local.as_strided((min(SAMPLES, -(-n // stride)),), (stride,))
        else:
            sample = local.reshape(-1)[::stride][:SAMPLES]
        samples.setdefault((local.dtype, local.device), []).append(sample)
    made = "|".join(names).encode(), list(samples.values())
    _sampled.clear()
    if all(local.is_contiguous() for _, _, local in found):  # else a sample is a copy
        _sampled[where] = made
    return made


def _replicated_tensors(state: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Module parameters and buffers, optimizer state tensors: no JSON tree is built."""
    found = []
    for name, value in sorted(state.items()):
        if isinstance(value, nn.Module):
            found += [(f"{name}/{k}", t) for k, t in value.state_dict(keep_vars=True).items()]
        elif isinstance(value, Optimizer):
            for i, per_param in enumerate(value.state.values()):
                for k, t in per_param.items():
                    if isinstance(t, torch.Tensor):
                        found.append((f"{name}/{i}/{k}", t))
    return found


# -- the registry ----------------------------------------------------------------------

_lock = threading.Lock()
_own: dict[str, dict[int, Record]] = {}  # job -> step -> this process's records
_held: dict[str, dict[int, dict[int, bytes]]] = {}  # job -> owner rank -> step -> record


def keep_own(job: str, record: Record) -> None:
    with _lock:
        mine = _own.setdefault(job, {})
        mine[record.step] = record
        for old in sorted(mine)[:-KEEP]:
            del mine[old]


def own(job: str, rank: int) -> Record | None:
    """This process's newest record as ``rank`` (a record under another rank number,
    from before a reassignment, does not count)."""
    with _lock:
        mine = [r for r in _own.get(job, {}).values() if r.rank == rank]
    return max(mine, key=lambda r: r.step, default=None)


def keep_held(job: str, owner: int, step: int, data: bytes) -> None:
    with _lock:
        steps = _held.setdefault(job, {}).setdefault(owner, {})
        steps[step] = data
        for old in sorted(steps)[:-KEEP]:
            del steps[old]


def held(job: str) -> dict[int, dict[int, bytes]]:
    """``{owner rank: {step: encoded record}}`` kept for peers."""
    with _lock:
        return {o: dict(s) for o, s in _held.get(job, {}).items()}


def forget(job: str) -> None:
    """Drop every record of ``job`` (the job finished)."""
    with _lock:
        _own.pop(job, None)
        _held.pop(job, None)


# -- point-to-point --------------------------------------------------------------------


FIRST = 64 * 1024  # bytes in the first message: a record usually fits, one round trip


def exchange(comm: Comm, send: dict[int, bytes], receive: list[int]) -> dict[int, bytes]:
    """Send ``send[peer]`` to each peer and receive one message from each rank in
    ``receive``. A first message of `FIRST` bytes carries the length and the start (a
    typical record whole); a longer one follows in a second message. Each round is one
    batch (no pair ordering to deadlock on). Every rank named must call it in the same
    sequence of calls."""
    if comm.group is None or not (send or receive):
        return {}
    out = {p: _first(b) for p, b in send.items()}
    into = {p: torch.empty(FIRST, dtype=torch.uint8) for p in receive}
    _run(comm, out, into)
    sizes = {p: int.from_bytes(into[p][:8].numpy().tobytes(), "little") for p in receive}
    _check_sizes(sizes, max((len(b) for b in send.values()), default=0))
    rest_out = {
        p: torch.frombuffer(bytearray(b[FIRST - 8 :]), dtype=torch.uint8)
        for p, b in send.items()
        if len(b) > FIRST - 8
    }
    rest_in = {p: torch.empty(n - (FIRST - 8), dtype=torch.uint8) for p, n in sizes.items()
               if n > FIRST - 8}  # fmt: skip
    _run(comm, rest_out, rest_in)
    got = {}
    for p, n in sizes.items():
        head = into[p][8 : 8 + min(n, FIRST - 8)].numpy().tobytes()
        got[p] = head + (rest_in[p].numpy().tobytes() if p in rest_in else b"")
    return got


MAX_SLACK = 4  # a peer's record may be this many times this rank's own...
MAX_FLOOR = 64 << 20  # ...or this many bytes, whichever is more


def _check_sizes(sizes: dict[int, int], own: int) -> None:
    """Refuse, before allocating, a record a peer says is far larger than this rank's
    own: ranks of one job keep records of the same kinds of state, so a size past the
    bound is a malformed message (or another program), never a reason to allocate."""
    limit = max(MAX_SLACK * own, MAX_FLOOR)
    for peer, size in sizes.items():
        if size > limit:
            raise CheckpointError(
                f"rank {peer} sent a step record of {size} bytes, over the {limit} this "
                f"rank accepts ({MAX_SLACK} x its own {own}): not allocated; every rank "
                "must run the same training script and unbroken version"
            )


def _first(data: bytes) -> torch.Tensor:
    first = bytearray(FIRST)
    first[:8] = len(data).to_bytes(8, "little")
    head = data[: FIRST - 8]
    first[8 : 8 + len(head)] = head
    return torch.frombuffer(first, dtype=torch.uint8)


TAG = 1  # records travel on the training thread while replicas (tag 0) may be on the worker


def _run(comm: Comm, out: dict[int, torch.Tensor], into: dict[int, torch.Tensor]) -> None:
    ops = [comm.p2p(dist.isend, t, p, TAG) for p, t in out.items()]
    ops += [comm.p2p(dist.irecv, t, p, TAG) for p, t in into.items()]
    comm.start(ops).wait()
