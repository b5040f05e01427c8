"""`Checkpointer`: save and restore the full training state, on one rank or many.

Save is collective. Its phases, each ending with every rank agreeing before the next:

1. capture: flatten the state, hash every local tensor block, agree on the step;
2. write: each rank writes the blocks the plan gives it (replicated ones once in all)
   and makes them durable;
3. commit: rank 0 writes the manifest atomically. Only now does the step exist.

A rank that fails in a phase still takes part in the exchange that ends it, so the others
learn of the failure and raise too instead of waiting for a collective that never comes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from unbroken.dist import Comm
from unbroken.errors import CheckpointError
from unbroken.format import (
    MANIFEST,
    Manifest,
    checksum,
    dtype_name,
    parse_step_dir,
    step_dir,
)
from unbroken.plan import Block, make_plan
from unbroken.shards import byte_view, dtensor_offsets, fill, local_block, write_blocks
from unbroken.state import capture, decode, is_stateful, tensor_keys
from unbroken.storage import Storage, open_storage

log = logging.getLogger("unbroken")
T = TypeVar("T")


class Checkpointer:
    """Sharded, atomic, checksummed checkpoints of a training job's state.

    >>> ckpt = Checkpointer("runs/exp1")
    >>> ckpt.save(step, {"model": model, "optim": optim, "rng": RNGState()})
    >>> step = ckpt.restore(state)  # newest committed step, loaded in place, or None

    Under torch.distributed, construct it on every rank (it creates its own gloo group for
    coordination) and call `save`/`restore` on every rank. ``path`` must be storage every
    rank sees (a shared file system) when ranks run on several nodes.

    Args:
        path: a directory (created if missing).
        keep: keep only the newest ``keep`` committed checkpoints; ``None`` keeps all.
        process_group: the ranks that checkpoint together; default: all of them.
        timeout: how long a rank waits for the others during save or restore.
        io_threads: parallel file writers per rank.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        timeout: float = 600.0,
        io_threads: int = 2,
    ) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint, or None to keep all")
        if io_threads < 1:
            raise ValueError(f"io_threads={io_threads}: at least one thread must write")
        self.path = os.fspath(path)
        self.keep = keep
        self.io_threads = io_threads
        self.storage: Storage = open_storage(self.path)
        self._comm = Comm(process_group, timedelta(seconds=timeout))

    @property
    def rank(self) -> int:
        return self._comm.rank

    # -- reading the directory -------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Directories without a manifest are not listed."""
        found = []
        for name in self.storage.list(""):
            step = parse_step_dir(name)
            if step is not None and self._committed(name):
                found.append(step)
        return sorted(found)

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest committed step)."""
        if step is None:
            steps = self.steps()
            if not steps:
                raise CheckpointError(f"{self.path} holds no committed checkpoint")
            step = steps[-1]
        where = f"{self.path}/{step_dir(step)}/{MANIFEST}"
        try:
            data = self.storage.read(f"{step_dir(step)}/{MANIFEST}")
        except FileNotFoundError:
            have = self.steps()
            raise CheckpointError(
                f"{self.path} has no committed checkpoint for step {step}; committed steps: "
                f"{_summary(have)}"
            ) from None
        manifest = Manifest.from_json(data, where)
        if manifest.step != step:
            raise CheckpointError(f"{where} says it is step {manifest.step}, not {step}")
        return manifest

    def _committed(self, folder: str) -> bool:
        try:
            self.storage.size(f"{folder}/{MANIFEST}")
            return True
        except FileNotFoundError:
            return False

    # -- save ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Save ``state`` as ``step``. Returns once the checkpoint is committed.

        ``state`` maps names to Stateful objects (modules, optimizers, schedulers,
        `RNGState`, `Progress`...), tensors and JSON values. Collective: every rank
        calls it with the same step. Saving a step that is already committed is an
        error; a failed save leaves every committed checkpoint as it was.
        """
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, not {step!r}")
        started = time.perf_counter()
        comm, folder = self._comm, step_dir(step)

        def prepare() -> tuple[list[tuple[str, torch.Tensor]], list[Block], dict[str, Any]]:
            if comm.rank == 0:
                self._clear(step)
            tensors, tree = capture(state)
            staged, blocks = [], []
            for key, t in tensors.items():
                local, offsets = local_block(t)
                staged.append((key, local))
                blocks.append(
                    Block(
                        key=key,
                        dtype=dtype_name(t.dtype),
                        shape=tuple(t.shape),
                        offsets=offsets,
                        local_shape=tuple(local.shape),
                        nbytes=local.nbytes,
                        xxh3=checksum(byte_view(local)),
                    )
                )
            return staged, blocks, tree

        staged, blocks, tree = self._together(f"saving step {step}", prepare)
        rows = comm.all_gather([step, [b.to_json() for b in blocks]])
        steps = [row[0] for row in rows]
        if len(set(steps)) > 1:
            raise CheckpointError(
                f"ranks disagree on the step to save: {dict(enumerate(steps))}; "
                "every rank must call save() with the same step"
            )
        plan = make_plan([[Block.from_json(b) for b in row[1]] for row in rows])
        mine = set(plan.writes[comm.rank])
        to_write = [(key, t) for key, t in staged if key in mine]

        def write() -> tuple[dict[str, tuple[str, int, int]], dict[str, int]]:
            return write_blocks(self.storage, folder, comm.rank, to_write, self.io_threads)

        locations, sizes = self._together(f"writing step {step}", write)
        gathered = comm.all_gather([locations, sizes, tree])

        def commit() -> None:
            if comm.rank != 0:
                return
            files: dict[str, int] = {}
            trees: list[dict[str, Any]] = []
            rank_objects: list[int] = []
            for rank, (where, rank_sizes, rank_tree) in enumerate(gathered):
                files.update(rank_sizes)
                for key, (file, start, end) in where.items():
                    chunk = plan.chunk_of[rank, key]
                    chunk.file, chunk.start, chunk.end = file, start, end
                if rank_tree not in trees:
                    trees.append(rank_tree)
                rank_objects.append(trees.index(rank_tree))
            manifest = Manifest(
                step=step,
                world_size=comm.world_size,
                created=time.time(),
                tensors=plan.tensors,
                objects=trees,
                rank_objects=rank_objects,
                files=files,
            )
            try:
                self.storage.commit(f"{folder}/{MANIFEST}", manifest.to_json())
            except FileExistsError:
                raise CheckpointError(
                    f"{self.path}: step {step} was committed by another writer meanwhile"
                ) from None

        self._together(f"committing step {step}", commit)
        if comm.rank == 0:
            written = sum(sizes for row in gathered for sizes in row[1].values())
            seconds = time.perf_counter() - started
            log.info("saved step %d: %.1f MiB in %.2f s", step, written / 2**20, seconds)
            self._retain()

    def _clear(self, step: int) -> None:
        """Before saving ``step``: refuse to replace it if committed; remove uncommitted
        leftovers of earlier crashed saves (nobody can be writing them: saves are collective
        and this one has not begun)."""
        folder = step_dir(step)
        if self._committed(folder):
            raise CheckpointError(
                f"{self.path}: step {step} is already committed; save under a new step, "
                f"or delete {folder} first"
            )
        for name in self.storage.list(""):
            if parse_step_dir(name) is not None and not self._committed(name):
                self.storage.delete(name)

    def _retain(self) -> None:
        if self.keep is None:
            return
        for step in self.steps()[: -self.keep]:
            # Manifest first: from that moment no reader sees a half-deleted checkpoint.
            self.storage.delete(f"{step_dir(step)}/{MANIFEST}")
            self.storage.delete(step_dir(step))

    # -- restore ---------------------------------------------------------------------

    def restore(
        self, state: MutableMapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> int | None:
        """Load a committed checkpoint into ``state`` in place and return its step.

        ``step=None`` takes the newest committed step, and returns None (touching
        nothing) when there is none. Tensors are read straight into the existing
        tensors where possible; Stateful objects then get ``load_state_dict``; plain JSON
        values are replaced in ``state``. Keys, shapes and files are all checked on every
        rank before any byte of ``state`` changes. ``strict=False`` skips top-level
        entries and module parameters present on one side only.
        """
        comm = self._comm

        requested = comm.all_gather(step)
        if len(set(requested)) > 1:
            raise CheckpointError(
                f"ranks disagree on the step to restore: {dict(enumerate(requested))}; "
                "every rank must call restore() with the same step"
            )

        def choose() -> int | None:
            if comm.rank != 0:
                return None
            if step is not None:
                self.manifest(step)  # raises a clear error if it is not committed
                return step
            steps = self.steps()
            return steps[-1] if steps else None

        chosen: int | None = comm.broadcast(self._together("finding a checkpoint", choose))
        if chosen is None:
            return None
        folder = step_dir(chosen)
        # Fresh optimizers get their state tensors first, so that the checkpoint is read
        # into them in place, sharded like their parameters (FSDP2 needs DTensor state).
        fresh = [o for o in state.values() if isinstance(o, Optimizer) and _init_state(o)]
        try:
            manifest, tree, reads = self._together(
                f"checking step {chosen}", lambda: self._restore_plan(state, chosen, strict)
            )
        except BaseException:
            for optim in fresh:
                optim.state.clear()  # as it was: nothing changes when a restore is refused
            raise

        def read_one(job: tuple[Any, ...]) -> tuple[str, torch.Tensor]:
            key, dest, region, offsets, chunks = job
            entry = manifest.tensors[key]
            if dest is None:
                dest = region = torch.empty(entry.shape, dtype=entry.torch_dtype)
            fill(self.storage, folder, key, entry, chunks, region, offsets)
            return key, dest

        def read() -> dict[str, torch.Tensor]:
            # Threads overlap one block's checksum (which holds the GIL) with the next
            # block's read (which releases it), and keep several reads in flight.
            with ThreadPoolExecutor(self.io_threads) as pool:
                return dict(pool.map(read_one, reads))

        loaded = self._together(f"reading step {chosen}", read)

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

        self._together(f"loading step {chosen} into the state", apply)
        return chosen

    def _restore_plan(
        self, state: Mapping[str, Any], step: int, strict: bool
    ) -> tuple[Manifest, dict[str, Any], list[Any]]:
        """Check everything a restore will touch, and list the reads it needs."""
        manifest = self.manifest(step)
        where = f"{self.path}/{step_dir(step)}"
        if manifest.world_size != self._comm.world_size:
            raise CheckpointError(
                f"{where} was saved by {manifest.world_size} ranks and this job has "
                f"{self._comm.world_size}; restore it with the same number of ranks"
            )
        saved = manifest.objects_for(self._comm.rank)
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
                rank = self._comm.rank
                chunks = [c for c in entry.chunks if c.ranks is None or rank in c.ranks]
                files.update(c.file for c in chunks)
                reads.append((key, dest, region, offsets, chunks))
        for file in sorted(files):
            try:
                size = self.storage.size(f"{step_dir(step)}/{file}")
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
        return manifest, tree, reads

    # -- plumbing --------------------------------------------------------------------

    def _together(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it fails anywhere, raise everywhere."""
        error: BaseException | None = None
        try:
            result = fn()
        except Exception as e:
            error = e
        failures = self._comm.agree(None if error is None else f"{error}")
        if error is not None:
            raise error
        if failures:
            raise CheckpointError(f"{what} failed on another rank: {'; '.join(failures)}")
        return result

    def close(self) -> None:
        self._comm.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.path!r}, rank={self.rank}/{self._comm.world_size})"


def _init_state(optim: Optimizer) -> bool:
    """Give a fresh optimizer its state with one zero-learning-rate step on zero grads.
    Returns False, doing nothing, if it already has state or any grad is set."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or any(p.grad is not None for p in params):
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


def _summary(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps[-10:])) + (" ..." if len(steps) > 10 else "")
