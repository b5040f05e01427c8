"""The lowest layer of moving block bytes: a tensor's bytes as a buffer, reading a byte
range of a shard file into one with errors that name the tensor, and checking a block
against its manifest checksum. Shared by `unbroken.shards` and `unbroken.coalesce`."""

from __future__ import annotations

import torch

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format import Chunk, verify_block
from unbroken.storage import Storage


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def read_into(
    storage: Storage, folder: str, key: str, file: str, start: int, out: memoryview
) -> None:
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


def verify_chunk(folder: str, key: str, chunk: Chunk, view: memoryview) -> None:
    verify_block(
        view,
        chunk.xxh3,
        f"{folder}: tensor {key!r} in {chunk.file} (bytes {chunk.start}-{chunk.end})",
        "; the file is damaged. Restore an earlier step (see `unbroken ls`).",
    )
