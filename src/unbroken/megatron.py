"""Megatron Core ``dist_checkpointing`` strategies that save into unbroken's format.

>>> from megatron.core import dist_checkpointing
>>> import unbroken.megatron
>>> dist_checkpointing.save(sharded_state_dict, "ckpt/iter_0000100",
...     sharded_strategy=unbroken.megatron.SaveStrategy(step=100))
>>> dist_checkpointing.load(sharded_state_dict, "ckpt/iter_0000100",
...     sharded_strategy=unbroken.megatron.LoadStrategy())

Megatron's ``torch_dist`` strategies translate its ShardedTensors and ShardedObjects into
a ``torch.distributed.checkpoint`` (DCP) state dict and write it with their own
FileSystemWriterAsync. These subclasses keep that translation and Megatron's planners
(`MCoreSavePlanner`, `MCoreLoadPlanner`: replica de-duplication, global-shape checks) and
hand the DCP state dict to `unbroken.dcp.Writer` / `unbroken.dcp.Reader` instead: every
block checksummed and verified on read, one manifest committed only once every rank has
written, any storage unbroken opens (``s3://`` included, through ``path=``).

What stays Megatron's: ``metadata.json`` (its format marker, backend ``"unbroken"``) and
``common.pt`` (the non-sharded common state, ``torch.save``) are written by Megatron's
``save`` into ``checkpoint_dir`` with plain file IO, unchecksummed. Megatron Core >= 0.17
keeps the common state in the sharded checkpoint and reads it back only through DCP's own
FileSystemReader, so `SaveStrategy` writes it to ``common.pt`` there too, where that
``load`` finds it. Saves are synchronous: `SaveStrategy.async_save` refuses (see its
docstring).

Megatron's own ``torch_dist`` save cannot run without CUDA (its FileSystemWriterAsync
calls ``torch.cuda.synchronize()``); these strategies run on CPU with gloo.

May import: dcp, errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from unbroken.dcp import Reader, Writer
from unbroken.errors import CheckpointError

__all__ = ["BACKEND", "LoadStrategy", "SaveStrategy"]

BACKEND = "unbroken"  # the sharded_backend Megatron writes into metadata.json
VERSION = 1
COMMON_KEY = "common_state"  # Megatron Core >= 0.17: the common state as a ShardedObject
COMMON_FILE = "common.pt"  # where Megatron's load looks for it outside DCP


def _where(path: str | os.PathLike[str] | None, checkpoint_dir: str | Path) -> str:
    """The unbroken directory: ``path`` if given, else Megatron's ``checkpoint_dir``."""
    return os.fspath(path if path is not None else checkpoint_dir)


class SaveStrategy(TorchDistSaveShardedStrategy):
    """Save Megatron's sharded state dict as step ``step`` of an unbroken checkpoint.

    Pass it as ``sharded_strategy`` to ``megatron.core.dist_checkpointing.save`` on every
    rank. The tensors and ShardedObjects go to ``path`` (default: ``checkpoint_dir``,
    so one Megatron checkpoint directory holds one unbroken step); ``storage_options``
    are as for `unbroken.Checkpointer`. Only main replicas are written
    (``replica_id == 0``), each by the rank that holds it. A step that is already
    committed is never replaced, and a save that fails on any rank commits nothing."""

    def __init__(
        self,
        step: int = 0,
        *,
        path: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        io_threads: int = 4,
    ) -> None:
        super().__init__(BACKEND, VERSION, keep_only_main_replica=True)
        if step < 0:
            raise ValueError(f"step={step}: steps are numbered from 0")
        self.step = step
        self.path = path
        self.storage_options = storage_options
        self.io_threads = io_threads

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Write every rank's main replicas, then commit one manifest (collective)."""
        sharded_state_dict = self._common_to_file(sharded_state_dict, checkpoint_dir)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        writer = Writer(
            _where(self.path, checkpoint_dir),
            step=self.step,
            storage_options=self.storage_options,
            io_threads=self.io_threads,
        )
        planner = MCoreSavePlanner(flatten_state_dict=False)
        dcp.save(mcore_to_pyt_state_dict(flat, False), storage_writer=writer, planner=planner)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any, *_: Any) -> Any:
        """Refused. Megatron's AsyncCallsQueue runs the write in a forked or persistent
        worker process and then all-reduces on ``torch.cuda.current_device()``; unbroken's
        writer plans and commits with collectives that must run in the training process.
        Save with ``async_sharded_save=False``, or use `unbroken.Checkpointer`'s
        ``save(..., blocking=False)``."""
        raise CheckpointError(
            "unbroken.megatron.SaveStrategy saves synchronously: call "
            "dist_checkpointing.save(..., async_sharded_save=False)"
        )

    def _common_to_file(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> ShardedStateDict:
        """Megatron Core >= 0.17 passes the common state as ShardedObject
        ``common_state`` and loads it from DCP's own format or ``common.pt``: take it
        out and write ``common.pt`` on rank 0, as Megatron Core < 0.17 does itself."""
        common = sharded_state_dict.get(COMMON_KEY)
        if not (isinstance(common, ShardedObject) and common.key == COMMON_KEY):
            return sharded_state_dict
        if dist.get_rank() == 0:
            torch.save(common.data, os.path.join(checkpoint_dir, COMMON_FILE))
        return {k: v for k, v in sharded_state_dict.items() if k != COMMON_KEY}


class LoadStrategy(TorchDistLoadShardedStrategy):
    """Load Megatron's sharded state dict from an unbroken checkpoint written by
    `SaveStrategy`: step ``step`` (default: the newest committed) of ``path`` (default:
    ``checkpoint_dir``).

    Pass it as ``sharded_strategy`` to ``megatron.core.dist_checkpointing.load`` on every
    rank. DCP's planner decides what each rank reads, so a checkpoint saved on N ranks
    loads on M with another sharding. Every stored block read is checked against its
    checksum before it is placed; a mismatch fails the load on every rank (DCP's
    ``CheckpointException``, holding unbroken's `CorruptCheckpointError`)."""

    def __init__(
        self,
        step: int | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        io_threads: int = 4,
    ) -> None:
        super().__init__()
        self.step = step
        self.path = path
        self.storage_options = storage_options
        self.io_threads = io_threads

    def reader(self, checkpoint_dir: str | Path) -> Reader:
        """A fresh `unbroken.dcp.Reader` over the step this strategy loads."""
        return Reader(
            _where(self.path, checkpoint_dir),
            step=self.step,
            storage_options=self.storage_options,
            io_threads=self.io_threads,
        )

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path, *_: Any
    ) -> StateDict:
        """Megatron's translation both ways, unbroken's reader in between (collective)."""
        tensors = [t for t in _values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={
                t.key: t for t in tensors if t.allow_shape_mismatch
            },
            flatten_state_dict=False,
            flatten_sharded_tensors=False,
        )
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        dcp.load(pyt_state_dict, storage_reader=self.reader(checkpoint_dir), planner=planner)
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, sharded_state_dict)
        return loaded

    def load_tensors_metadata(
        self, checkpoint_dir: str | Path, metadata: Metadata | None = None
    ) -> dict[str, ShardedTensor]:
        """Each stored tensor's key, global shape and dtype, from unbroken's manifest."""
        if metadata is None:
            metadata = self.reader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """Tensors and ShardedObjects in the checkpoint, as `load_tensors_metadata`."""
        metadata = self.reader(checkpoint_dir).read_metadata()
        found: dict[str, Any] = {}
        for key, stored in metadata.state_dict_metadata.items():
            if isinstance(stored, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                found[obj.unique_key] = obj
        found.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return found

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Megatron Core < 0.17 asks this of the backend in ``metadata.json``."""
        if loaded_backend != BACKEND:
            raise CheckpointError(
                f"this checkpoint was saved with Megatron's {loaded_backend!r} backend, not "
                f"through unbroken.megatron.SaveStrategy: load it with Megatron's own strategy"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version > VERSION:
            raise CheckpointError(
                f"checkpoint format version {loaded_version} is newer than this unbroken "
                f"reads ({VERSION}): upgrade unbroken"
            )


def _values(tree: Any) -> list[Any]:
    """The leaves of nested dicts and lists."""
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in _values(v)]
    if isinstance(tree, list | tuple):
        return [leaf for v in tree for leaf in _values(v)]
    return [tree]
