"""DCP's `Metadata` as JSON and back, without pickle.

DCP's own `FileSystemWriter` pickles `Metadata`, so reading its ``.metadata`` can run
code. Here the parts a load needs are written as JSON::

    {"version": "1.0.0",
     "state_dict": {fqn: {"type": "tensor", "dtype": "F32", "size": [4, 8],
                          "chunks": [{"offsets": [0, 0], "sizes": [2, 8]}, ...]}
                    | {"type": "bytes"}},
     "planner_data": {fqn: [path, ...]} | null,   # DefaultSavePlanner's flattening
     "storage_meta": {"checkpoint_id": ..., "save_id": ..., "modules": [...]} | null}

``storage_data`` (where each item is stored) is not kept here: the manifest's chunks say
it, and the reader rebuilds it from them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.layout import dtype_name, torch_dtype

Json = Any


def to_json(metadata: Metadata) -> dict[str, Json]:
    """``metadata`` as JSON; `CheckpointError` if a custom planner put something in
    ``planner_data`` that JSON cannot hold exactly (only pickle could)."""
    state: dict[str, Json] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[fqn] = {"type": "bytes"}
            continue
        state[fqn] = {
            "type": "tensor",
            "dtype": dtype_name(md.properties.dtype),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    meta = metadata.storage_meta
    return {
        "version": metadata.version,
        "state_dict": state,
        "planner_data": planner_paths(metadata.planner_data),
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
            "save_id": meta.save_id,
            "modules": list(meta.modules),
        },
    }


def planner_paths(data: object) -> dict[str, list[str | int]] | None:
    """DefaultSavePlanner's ``planner_data`` (fqn -> path of keys in the nested state
    dict) as JSON lists; None stays None. Anything else is refused."""
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(fqn, str)
        and isinstance(path, tuple)
        and all(isinstance(p, str | int) and not isinstance(p, bool) for p in path)
        for fqn, path in data.items()
    ):
        return {fqn: list(path) for fqn, path in data.items()}
    raise CheckpointError(
        f"the save planner's planner_data is a {type(data).__name__} that JSON cannot hold; "
        "unbroken.dcp stores DCP metadata as JSON, never pickle. Use DefaultSavePlanner, or "
        "a planner whose planner_data is None or {fqn: tuple of str/int}"
    )


def from_json(raw: Json, where: str) -> Metadata:
    """The `Metadata` that `to_json` wrote (``storage_data`` left for the reader)."""
    try:
        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, md in raw["state_dict"].items():
            if md["type"] == "bytes":
                state[fqn] = BytesStorageMetadata()
                continue
            dtype = torch_dtype(md["dtype"], f"{where}: DCP item {fqn!r}")
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(md["size"]),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])
                    )
                    for c in md["chunks"]
                ],
            )
        paths = raw["planner_data"]
        meta = raw["storage_meta"]
        return Metadata(
            state_dict_metadata=state,
            planner_data=None if paths is None else {k: tuple(v) for k, v in paths.items()},
            storage_meta=None if meta is None else StorageMeta(**meta),
            version=raw["version"],
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: malformed DCP metadata ({e!r})") from None
