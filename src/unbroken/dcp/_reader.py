"""`Reader`: a DCP `StorageReader` over checkpoints that `Writer` committed."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from unbroken.dcp._layout import DcpCheckpoint, Where, locate, open_checkpoint
from unbroken.dcp._metadata import from_json
from unbroken.errors import CheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import MANIFEST
from unbroken.format.shards import read_many
from unbroken.job.gc_paused import building
from unbroken.storage import open_storage

# Stored chunks are read in batches of about this many bytes, then copied out: a load
# that reshards never holds more than this in staging copies at once.
BATCH_BYTES = 256 << 20


class Reader(StorageReader):
    """Load with ``torch.distributed.checkpoint.load`` from step ``step`` (default: the
    newest committed) of the unbroken checkpoint directory ``path``.

    >>> dcp.load(state, storage_reader=unbroken.dcp.Reader("s3://b/run"))

    DCP's planners choose what each rank reads, so loads onto a different number of
    ranks (resharding) work as with DCP's own reader. Every stored block a rank reads is
    checked against its checksum before any of it is placed; a mismatch raises
    `CorruptCheckpointError` naming the tensor and the file. Bytes items are handed to
    the planner as stored: DCP's default planner unpickles them (``torch.load`` with
    ``weights_only=False``), which is DCP's behaviour, so load bytes items only from
    checkpoints you trust."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        io_threads: int = 4,
    ) -> None:
        super().__init__()
        self.step = step
        self.storage_options = storage_options
        self.io_threads = io_threads
        self._open(path)
        self._checkpoint: DcpCheckpoint | None = None
        self._where: dict[MetadataIndex, Where] = {}

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.directory = Directory(open_storage(self.path, self.storage_options), self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._open(checkpoint_id)
        self._checkpoint, self._where = None, {}

    def read_metadata(self) -> Metadata:
        """DCP's metadata, rebuilt from the manifest's JSON; ``storage_data`` maps each
        item to its stored chunk."""
        ckpt = open_checkpoint(self.directory, self.step)
        where = f"{self.path}/{ckpt.folder}/{MANIFEST}"
        with building():  # an object per stored chunk: hundreds of thousands at scale
            metadata = from_json(ckpt.metadata, where)
            metadata.storage_data = locate(ckpt, metadata, where)
        self._checkpoint = ckpt
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._where = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every stored chunk ``plan`` touches, verified, and place the requested
        parts. A chunk wanted whole by one item lands straight in its destination."""
        if self._checkpoint is None:
            raise CheckpointError("read_data() before read_metadata(): call dcp.load")
        wanted: dict[int, tuple[Where, list[ReadItem]]] = {}
        for item in plan.items:
            try:
                where = self._where[item.storage_index]
            except KeyError:
                raise CheckpointError(
                    f"{self.path}: the load plan asks for {item.storage_index}, which the "
                    "checkpoint does not hold"
                ) from None
            wanted.setdefault(id(where), (where, []))[1].append(item)
        for batch in _batches(list(wanted.values())):
            self._read_batch(batch, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_batch(self, batch: list[tuple[Where, list[ReadItem]]], planner: LoadPlanner) -> None:
        assert self._checkpoint is not None
        reads, direct = [], []
        for where, items in batch:
            target = _direct_target(where, items, planner)
            out = target if target is not None else torch.empty(
                where.chunk.shape, dtype=where.entry.torch_dtype
            )  # fmt: skip
            reads.append((where.key, where.entry, where.chunk, out))
            direct.append(target is not None)
        read_many(self.directory.storage, self._checkpoint.folder, reads, self.io_threads)
        for (_, items), (_, _, _, data), placed in zip(batch, reads, direct, strict=True):
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(data.numpy().tobytes()))
                elif placed:
                    planner.commit_tensor(item, data)
                else:
                    _place(item, data, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


def _batches(
    wanted: list[tuple[Where, list[ReadItem]]],
) -> Iterator[list[tuple[Where, list[ReadItem]]]]:
    """``wanted`` in file order, cut into batches of about `BATCH_BYTES`."""
    batch: list[tuple[Where, list[ReadItem]]] = []
    size = 0
    for pair in sorted(wanted, key=lambda p: (p[0].chunk.file, p[0].chunk.start)):
        if batch and size + pair[0].chunk.nbytes > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(pair)
        size += pair[0].chunk.nbytes
    if batch:
        yield batch


def _direct_target(
    where: Where, items: list[ReadItem], planner: LoadPlanner
) -> torch.Tensor | None:
    """The destination to read ``where`` straight into: when one item wants all of it
    and the planner's tensor for it is a contiguous CPU tensor of the stored dtype."""
    if len(items) != 1 or items[0].type == LoadItemType.BYTE_IO:
        return None
    item = items[0]
    if list(item.lengths) != where.chunk.shape or any(item.storage_offsets):
        return None
    target = planner.resolve_tensor(item).detach()
    if (
        target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == where.entry.torch_dtype
        and list(target.shape) == where.chunk.shape
    ):
        return target
    return None


def _place(item: ReadItem, data: torch.Tensor, planner: LoadPlanner) -> None:
    """Copy the part of the stored chunk ``data`` that ``item`` asks for into place."""
    src = data
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        src = src.narrow(dim, start, length)
    target = planner.resolve_tensor(item).detach()
    if target.shape != src.shape:
        raise CheckpointError(
            f"DCP item {item.dest_index.fqn!r}: the planner's destination has shape "
            f"{list(target.shape)}, the stored part {list(src.shape)}"
        )
    target.copy_(src)
    planner.commit_tensor(item, target)
