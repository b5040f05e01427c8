"""A save's blocks and their checksums, each hashed where it costs least.

The write plan (`unbroken.format.write_plan`) writes a region several ranks hold once,
choosing among the holders of each value by checksum, so those blocks are hashed before
anything is written (and `unbroken.sdc` compares them then). A region one rank alone
holds (a shard, per-rank state) is that rank's to write whatever its checksum: it is
hashed while it uploads, and its checksums reach the manifest in the chunk its writer
encodes (`unbroken.saving.pipeline._chunks`). A
sharded save thus sends its first byte without hashing first; a data-parallel one hashes
its replicated state first, as it must."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from unbroken.format.blockio import run_all
from unbroken.format.layout import block_checksums, dtype_name
from unbroken.format.shards import byte_view
from unbroken.format.write_plan import Block

Sums = dict[str, dict[str, Any]]  # key -> its block's `format.Checksums`, as a dict


class Staged(Protocol):
    """What a save captured (`unbroken.saving.pipeline.Staged`): its blocks, in order."""

    keys: list[str]
    blocks: list[torch.Tensor]
    offsets: list[tuple[int, ...]]
    shapes: list[tuple[int, ...]]
    aliases: dict[str, str]


def layout(staged: Staged) -> list[Block]:
    """This rank's blocks, their checksums not known yet."""
    return [
        Block(
            key=key,
            dtype=dtype_name(t.dtype),
            shape=shape,
            offsets=offsets,
            local_shape=tuple(t.shape),
            nbytes=t.nbytes,
            xxh3="",
            alias_of=staged.aliases.get(key),
        )
        for key, t, offsets, shape in zip(
            staged.keys, staged.blocks, staged.offsets, staged.shapes, strict=True
        )
    ]


def checksums(
    staged: Staged, keys: Iterable[str], threads: int, beside: Callable[[], None] | None = None
) -> Sums:
    """The checksums of the blocks of ``keys``, on ``threads`` IO workers (xxh3 releases
    the GIL); ``beside`` runs beside them. A tied key's bytes are its original's: hashed
    once."""
    keys = list(keys)
    index = {key: i for i, key in enumerate(staged.keys)}
    sums: Sums = {}

    def one(key: str | None) -> None:
        if key is None:
            assert beside is not None
            beside()
        else:
            sums[key] = block_checksums(byte_view(staged.blocks[index[key]])).fields()

    first: list[str | None] = [None] if beside is not None else []
    todo = first + sorted({staged.aliases.get(k, k) for k in keys})
    run_all(one, todo, threads)
    return {key: sums[staged.aliases.get(key, key)] for key in keys}
