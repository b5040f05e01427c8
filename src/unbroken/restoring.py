"""The restore pipeline: choose a step every rank agrees on, check everything it will touch,
read straight into the live tensors, then hand each Stateful its state.

Keys, shapes, files and sizes are all checked on every rank before any byte of the state
changes, so bad input costs nothing. A checksum failure found while reading leaves the
state partly overwritten; the error says so, and which step to try instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from unbroken import replicas
from unbroken.dist import Comm
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format import Manifest, TensorEntry, checksum, step_dir
from unbroken.shards import byte_view, dtensor_offsets, fill, read_many
from unbroken.state import capture, decode, is_stateful, tensor_keys
from unbroken.storage import Storage
from unbroken.storage.local import LocalStorage

if TYPE_CHECKING:
    from unbroken.checkpointer import Checkpointer

log = logging.getLogger("unbroken")


@dataclass(frozen=True)
class Origin:
    """Where one rank's state came from: ``"storage"``, its own node's shared
    ``"memory"``, or the ``"replica"`` of it that rank ``peer`` kept."""

    kind: Literal["storage", "memory", "replica"]
    step: int
    peer: int | None = None


@dataclass(frozen=True)
class Restored:
    """What a restore loaded: the step, and where each rank's state came from
    (``origins[r]`` for rank r; the same on every rank)."""

    step: int
    origins: tuple[Origin, ...]
    rank: int

    @property
    def origin(self) -> Origin:
        """This rank's."""
        return self.origins[self.rank]


def restore(
    ckpt: Checkpointer, state: MutableMapping[str, Any], step: int | None, strict: bool
) -> Restored | None:
    comm = ckpt._comm

    requested = comm.all_gather(step)
    if len(set(requested)) > 1:
        raise CheckpointError(
            f"ranks disagree on the step to restore: {dict(enumerate(requested))}; "
            "every rank must call restore() with the same step"
        )

    memory = ckpt._memory
    rejected: set[int] = set()  # steps whose copy in memory failed a checksum somewhere
    storage: Storage | None  # None: this rank's bytes come from a peer's replica
    plan: dict[int, int] = {}  # ranks whose copy comes from a peer -> that peer
    while True:
        in_memory = _in_memory(ckpt, rejected)

        def choose(in_memory: dict[int, Any] = in_memory) -> int | None:
            if comm.rank != 0:
                return None
            if step is not None:
                if step not in in_memory:
                    ckpt.manifest(step)  # raises a clear error if it is not committed
                return step
            stored = ckpt._latest()
            newest = max(in_memory, default=None)
            if newest is not None and (stored is None or newest >= stored):
                return newest
            return stored

        chosen: int | None = comm.broadcast(comm.together("finding a checkpoint", choose))
        if chosen is None:
            return None
        if chosen not in in_memory:
            manifest, storage, folder = ckpt.manifest(chosen), ckpt.storage, step_dir(chosen)
            where = f"{ckpt.path}/{folder}"
            break
        assert memory is not None
        plan = {r: min(q) for r, q in sorted(in_memory[chosen].items())}  # lost -> provider
        # Only the copies to be used are checksummed, once, here (a provider checks the
        # replica it will send): no pass over the others, and none again on reading.
        checks = [memory.replica(r).intact(chosen) for r, p in plan.items() if p == comm.rank]
        own = memory.own.intact(chosen) if comm.rank not in plan else None
        if comm.rank not in plan:
            checks.append(own)
        intact = comm.all_gather(all(m is not None for m in checks))
        if all(intact):
            folder = "."
            text = replicas.manifests(comm, memory, chosen, plan) if plan else None
            if own is not None:
                manifest, storage = own, LocalStorage(memory.dir)
                where = f"shared memory {memory.dir} (step {chosen})"
            else:  # this rank's copy is gone: its bytes come from plan[rank], not storage
                assert text is not None
                where = f"the replica on rank {plan[comm.rank]} (step {chosen})"
                manifest, storage = Manifest.from_json(text.encode(), where), None
            if plan:
                log.info("step %d recovered from peer replicas for ranks %s", chosen, sorted(plan))
            log.info("restoring step %d from shared memory", chosen)
            break
        bad = [r for r, ok in enumerate(intact) if not ok]
        log.warning("step %d in shared memory is damaged on ranks %s; not using it", chosen, bad)
        rejected.add(chosen)
    # Fresh optimizers of sharded parameters get their state tensors first, so that the
    # checkpoint is read into them in place, sharded like their parameters (FSDP2 needs
    # DTensor state).
    fresh = [o for o in state.values() if isinstance(o, Optimizer) and _init_state(o)]
    try:
        tree, reads = comm.together(
            f"checking step {chosen}",
            lambda: _check(comm, state, manifest, storage, folder, where, strict),
        )
    except BaseException:
        for optim in fresh:
            optim.state.clear()  # as it was: nothing changes when a restore is refused
        raise

    # Memory is read where it is: a rank's snapshot holds its own values, per-rank ones
    # too, so nothing is broadcast from another rank's copy.
    from_storage = storage is ckpt.storage
    readers = _readers(comm, manifest, reads, ckpt.replicated_reads) if from_storage else {}
    buffers: dict[str, torch.Tensor] = {}

    def read() -> dict[str, torch.Tensor]:
        loaded, whole, partial = {}, [], []
        for key, dest, region, offsets, chunks in reads:
            entry = manifest.tensors[key]
            if key in readers:  # read by one rank, then broadcast: needs a CPU buffer
                buffers[key] = region = _cpu_buffer(dest, entry)
                dest = region if dest is None else dest
                if readers[key] != comm.rank:
                    loaded[key] = dest
                    continue
            elif dest is None:
                dest = region = torch.empty(entry.shape, dtype=entry.torch_dtype)
            loaded[key] = dest
            exact = [c for c in chunks if c.offsets == offsets and c.shape == list(region.shape)]
            if (
                exact
                and region.device.type == "cpu"
                and region.is_contiguous()
                and (region.dtype == entry.torch_dtype)
            ):
                whole.append((key, entry, exact[0], region))
            else:
                partial.append((key, entry, chunks, region, offsets))
        if storage is None:
            _receive(comm, manifest, plan[comm.rank], whole, partial)
            return loaded
        sending = replicas.send(comm, memory, chosen, plan) if memory and plan else []
        # Threads overlap one block's checksum (which holds the GIL) with the next
        # block's read (which releases it), and keep several reads in flight. A copy in
        # memory was checksummed just before.
        read_many(storage, folder, whole, ckpt.io_threads, verify=from_storage)
        with ThreadPoolExecutor(ckpt.io_threads) as pool:
            for done in pool.map(lambda job: fill(storage, folder, *job), partial):
                del done
        replicas.wait(sending)
        return loaded

    loaded = comm.together(f"reading step {chosen}", read)
    if readers:
        for key in sorted(readers):  # every rank, in one order: the read phase succeeded
            comm.broadcast_bytes(byte_view(buffers[key]), readers[key])

        def receive() -> None:
            for key, reader in readers.items():
                chunk = manifest.tensors[key].chunks[0]
                if reader != comm.rank and checksum(byte_view(buffers[key])) != chunk.xxh3:
                    raise CorruptCheckpointError(
                        f"{folder}: tensor {key!r} from rank {reader} fails its checksum"
                    )
                if loaded[key] is not buffers[key]:
                    loaded[key].copy_(buffers[key])

        comm.together(f"receiving step {chosen}", receive)

    def apply() -> None:
        for name, encoded in tree.items():
            value = decode(encoded, loaded)
            target = state[name]
            if isinstance(target, nn.Module):
                target.load_state_dict(value, strict=strict)
            elif is_stateful(target):
                target.load_state_dict(value)
            elif not isinstance(target, torch.Tensor):
                state[name] = value

    comm.together(f"loading step {chosen} into the state", apply)
    if from_storage:
        origins = [Origin("storage", chosen)] * comm.world_size
    else:
        origins = [
            Origin("replica", chosen, plan[r]) if r in plan else Origin("memory", chosen)
            for r in range(comm.world_size)
        ]
    return Restored(step=chosen, origins=tuple(origins), rank=comm.rank)


def _receive(
    comm: Comm, manifest: Manifest, provider: int, whole: list[Any], partial: list[Any]
) -> None:
    """Fill this rank's tensors from ``provider``'s replica of its snapshot: block by
    block, straight into the live tensors where they are CPU, contiguous and of the
    saved dtype, through a buffer otherwise; then check every block's checksum."""
    arriving = [(key, chunk, region, region) for key, _, chunk, region in whole]
    for key, entry, chunks, region, _ in partial:
        if chunks[0].shape != list(region.shape):
            raise CheckpointError(
                f"the replica on rank {provider}: tensor {key!r} has shape {chunks[0].shape}, "
                f"this rank's is {list(region.shape)}"
            )
        buffer = torch.empty(chunks[0].shape, dtype=entry.torch_dtype)
        arriving.append((key, chunks[0], buffer, region))
    into = {key: data.reshape(-1).view(torch.uint8) for key, _, data, _ in arriving}
    replicas.wait(replicas.receive(comm, manifest, provider, into))
    for key, chunk, data, region in arriving:
        if checksum(byte_view(data)) != chunk.xxh3:
            raise CorruptCheckpointError(
                f"the replica on rank {provider}: tensor {key!r} fails its checksum on arrival"
            )
        if data is not region:
            region.copy_(data)


def _in_memory(ckpt: Checkpointer, rejected: set[int]) -> dict[int, dict[int, list[int]]]:
    """The steps every rank can get from shared memory: from its own, or, for a rank
    whose copy is gone, from a peer's replica. ``{step: {lost rank: replica holders}}``.
    Collective."""
    memory = ckpt._memory
    own, kept = [], {}
    if memory is not None:
        own = sorted(memory.snapshots())
        kept = {str(o): sorted(memory.replica(o).whole()) for o in ckpt._replica_sources}
    table = ckpt._comm.all_gather([own, kept])
    found = {}
    for candidate in {s for steps, _ in table for s in steps} | {
        s for _, k in table for steps in k.values() for s in steps
    }:
        if candidate in rejected:
            continue
        lost = {r for r, (steps, _) in enumerate(table) if candidate not in steps}
        holders = {
            r: [q for q, (_, k) in enumerate(table) if candidate in k.get(str(r), [])] for r in lost
        }
        if all(holders.values()):
            found[candidate] = holders
    return found


def _readers(comm: Comm, manifest: Manifest, reads: list[Any], mode: str) -> dict[str, int]:
    """For ``replicated_reads`` other than "each": which rank reads each tensor that every
    rank restores whole from one stored block (DDP parameters, optimizer state). The
    others receive it by broadcast instead of fetching the same bytes from storage."""
    if mode == "each" or comm.world_size == 1:
        return {}
    sizes = {
        key: chunks[0].nbytes
        for key, dest, _, _, chunks in reads
        if len(chunks) == 1
        and chunks[0].ranks is None
        and chunks[0].shape == manifest.tensors[key].shape
        and not isinstance(dest, DTensor)
    }
    # Only if every rank restores the same set: otherwise each reads its own.
    digest = checksum(memoryview(json.dumps(sorted(sizes)).encode()))
    if len(set(comm.all_gather(digest))) > 1:
        return {}
    if mode == "broadcast":
        return dict.fromkeys(sizes, 0)
    load = [0] * comm.world_size
    readers = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):  # "slice": balance the bytes
        rank = min(range(comm.world_size), key=lambda r: (load[r], r))
        readers[key] = rank
        load[rank] += sizes[key]
    return readers


def _cpu_buffer(dest: torch.Tensor | None, entry: TensorEntry) -> torch.Tensor:
    """``dest`` itself if a broadcast can land in it, else a new CPU tensor."""
    if (
        dest is not None
        and dest.device.type == "cpu"
        and dest.is_contiguous()
        and dest.dtype == entry.torch_dtype
    ):
        return dest
    return torch.empty(entry.shape, dtype=entry.torch_dtype)


def _check(
    comm: Comm,
    state: Mapping[str, Any],
    manifest: Manifest,
    storage: Storage | None,
    folder: str,
    where: str,
    strict: bool,
) -> tuple[dict[str, Any], list[Any]]:
    """Check everything a restore will touch, and list the reads it needs. ``storage``
    None: the bytes come from a peer, which checked its copy."""
    if manifest.world_size != comm.world_size:
        raise CheckpointError(
            f"{where} was saved by {manifest.world_size} ranks and this job has "
            f"{comm.world_size}; restore it with the same number of ranks"
        )
    saved = manifest.objects_for(comm.rank)
    current, _ = capture(state)
    names = saved.keys() & state.keys()
    if strict:
        _mismatch(where, "state entry", state.keys() - saved.keys(), saved.keys() - names)
    tree = {}
    for name in names:
        keys = set(tensor_keys(saved[name]))
        if isinstance(state[name], nn.Module):
            here = {k for k in current if k.startswith(f"{name}/")}
            if strict:
                _mismatch(where, f"tensor of {name!r}", here - keys, keys - here)
            keys &= here
        tree[name] = _prune(saved[name], keys)
    reads = []
    files: set[str] = set()
    for name in tree:
        for key in tensor_keys(tree[name]):
            entry = manifest.tensors.get(key)
            if entry is None:
                raise CheckpointError(f"{where}: the manifest lists no tensor {key!r}")
            dest = current.get(key)
            region, offsets = dest, [0] * len(entry.shape)
            if isinstance(dest, DTensor):
                region, offsets = dest.to_local(), list(dtensor_offsets(dest))
            if dest is not None and list(dest.shape) != entry.shape:
                raise CheckpointError(
                    f"{where}: tensor {key!r} has shape {entry.shape} in the checkpoint "
                    f"but {list(dest.shape)} in the state; build the model with the "
                    "configuration it was saved with"
                )
            rank = comm.rank
            chunks = [c for c in entry.chunks if c.ranks is None or rank in c.ranks]
            files.update(c.file for c in chunks)
            reads.append((key, dest, region, offsets, chunks))
    if storage is None:
        return tree, reads
    for file in sorted(files):
        try:
            size = storage.size(f"{folder}/{file}")
        except FileNotFoundError:
            raise CheckpointError(
                f"{where}/{file} is missing; the checkpoint is damaged. Restore an "
                "earlier step (see `unbroken ls`)"
            ) from None
        if size != manifest.files[file]:
            raise CheckpointError(
                f"{where}/{file} is {size} bytes but was written with "
                f"{manifest.files[file]}: it is truncated or damaged. Restore an "
                "earlier step (see `unbroken ls`)"
            )
    return tree, reads


def _init_state(optim: Optimizer) -> bool:
    """Give a fresh optimizer of sharded (DTensor) parameters its state with one
    zero-learning-rate step on zero grads. Returns False, doing nothing, if it already
    has state, any grad is set, or no parameter is a DTensor: plain tensors of state are
    read into new tensors, which costs nothing like a step over the whole model."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if (
        optim.state
        or any(p.grad is not None for p in params)
        or not any(isinstance(p, DTensor) for p in params)
    ):
        return False
    lrs = [group["lr"] for group in optim.param_groups]
    for group in optim.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs, strict=True):
            group["lr"] = lr
        optim.zero_grad(set_to_none=True)
    return True


def _mismatch(where: str, what: str, missing: set[str], unexpected: set[str]) -> None:
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {sorted(missing)[:10]}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the state: {sorted(unexpected)[:10]}")
    if problems:
        raise CheckpointError(
            f"{where}: {what} keys differ ({'; '.join(problems)}); pass strict=False to "
            "restore only the keys both have"
        )


def _prune(tree: Any, keep: set[str]) -> Any:
    """``tree`` without the tensor placeholders whose key is not in ``keep``."""
    if isinstance(tree, list):
        return [_prune(v, keep) for v in tree]
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tree
        return {
            k: _prune(v, keep)
            for k, v in tree.items()
            if not (isinstance(v, dict) and "__tensor__" in v and v["__tensor__"] not in keep)
        }
    return tree
