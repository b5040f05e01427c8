"""`Writer`: a DCP `StorageWriter` that saves into unbroken's checksummed format."""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from unbroken.dcp._layout import (
    Stored,
    block_name,
    bytes_tensor,
    commit,
    refuse_committed,
    stored_chunk,
)
from unbroken.dcp._metadata import to_json
from unbroken.errors import CheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import dtype_name, step_dir
from unbroken.format.shards import byte_view, write_blocks
from unbroken.job.gc_paused import building
from unbroken.storage import open_storage


@dataclass(frozen=True)
class _Rank:
    """SavePlan.storage_data: the rank whose shard files a plan's items go to."""

    rank: int


class Writer(StorageWriter):
    """Save with ``torch.distributed.checkpoint.save`` into step ``step`` of the unbroken
    checkpoint directory ``path`` (local, ``s3://...``, or any fsspec URL; options as for
    `unbroken.Checkpointer`).

    >>> dcp.save(state, storage_writer=unbroken.dcp.Writer("s3://b/run", step=100))

    Each rank writes its items into its own shard files (safetensors layout); the
    coordinator then commits one manifest holding every block's checksum and DCP's
    metadata as JSON, and moves ``latest``. Until that commit the step does not exist,
    for DCP and for unbroken alike. A step that is already committed is never replaced.
    DCP's ``checkpoint_id``, if given, replaces ``path``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int,
        storage_options: dict[str, Any] | None = None,
        io_threads: int = 4,
    ) -> None:
        super().__init__()
        if step < 0:
            raise ValueError(f"step={step}: steps are numbered from 0")
        self.step = step
        self.storage_options = storage_options
        self.io_threads = io_threads
        self._open(path)
        self.rank = 0
        self.is_coordinator = True
        self.use_collectives = True
        self.save_id = uuid.uuid4().hex

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.directory = Directory(open_storage(self.path, self.storage_options), self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._open(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.use_collectives:
            raise CheckpointError(
                "unbroken.dcp.Writer commits one manifest for all ranks; save with "
                "use_collectives=True (the default)"
            )
        if self.is_coordinator:
            refuse_committed(self.directory, self.step)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [replace(plan, storage_data=_Rank(i)) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items (tensors: the planned projection, moved to the CPU;
        bytes items: as they are) into its shard files, and report each one's chunk."""
        rank = plan.storage_data.rank if isinstance(plan.storage_data, _Rank) else self.rank
        blocks: list[tuple[str, torch.Tensor]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                tensor = bytes_tensor(data.getvalue())
            else:
                assert isinstance(data, torch.Tensor)
                tensor = data.detach().to("cpu").contiguous()
            blocks.append((block_name(item.index.fqn, item.index.offset), tensor))
        if not blocks:  # write_blocks would leave a header-only file no manifest names
            return _done([])
        where, sizes = write_blocks(
            self.directory.storage, step_dir(self.step), rank, blocks, self.io_threads
        )
        results = []
        for item, (name, tensor) in zip(plan.items, blocks, strict=True):
            file, start, end = where[name]
            offsets = list(item.index.offset or [0] * tensor.dim())
            chunk = stored_chunk(offsets, list(tensor.shape), file, start, end, byte_view(tensor))
            stored = Stored(item.index.fqn, dtype_name(tensor.dtype), chunk, sizes[file])
            results.append(WriteResult(index=item.index, size_in_bytes=end - start,
                                       storage_data=stored))  # fmt: skip
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, once every rank has written: commit the manifest."""
        if metadata.version is None:
            metadata.version = CURRENT_DCP_VERSION
        if metadata.storage_meta is None:
            metadata.storage_meta = self.storage_meta()
        with building():
            meta = to_json(metadata)
            stored = [r.storage_data for rank in results for r in rank]
        commit(self.directory, self.step, max(1, len(results)), stored, meta,
               meta["planner_data"])  # fmt: skip

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


def _done(results: list[WriteResult]) -> Future[list[WriteResult]]:
    future: Future[list[WriteResult]] = Future()
    future.set_result(results)
    return future
