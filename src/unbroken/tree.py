"""The JSON tree of a state's structure: every ``state_dict``'s values, with each tensor
a ``{"__tensor__": key}`` placeholder, tuples as ``{"__tuple__": [...]}`` and mappings
whose keys are not plain strings as ``{"__items__": [[key, value], ...]}``.

`unbroken.state.capture` builds it; reading it back needs no torch, so tools that only
show a checkpoint (``unbroken show``) do not import it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

Json = Any  # None | bool | int | float | str | list[Json] | dict[str, Json]

TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"


def decode(value: Json, tensors: Mapping[str, Any]) -> Any:
    """Inverse of the encoding made by `unbroken.state.capture`, with tensors taken
    from ``tensors``."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if TENSOR in value:
            return tensors[value[TENSOR]]
        if TUPLE in value:
            return tuple(decode(v, tensors) for v in value[TUPLE])
        if ITEMS in value:
            return {k: decode(v, tensors) for k, v in value[ITEMS]}
        return {k: decode(v, tensors) for k, v in value.items()}
    return value


def tensor_keys(value: Json) -> list[str]:
    """Keys of every tensor placeholder in an encoded tree, in order."""
    if isinstance(value, list):
        return [k for v in value for k in tensor_keys(v)]
    if isinstance(value, dict):
        if TENSOR in value:
            return [value[TENSOR]]
        return [k for v in value.values() for k in tensor_keys(v)]
    return []


def prune(tree: Json, keep: set[str]) -> Json:
    """``tree`` without the tensor placeholders whose key is not in ``keep``."""
    if isinstance(tree, list):
        return [prune(v, keep) for v in tree]
    if isinstance(tree, dict):
        if TENSOR in tree:
            return tree
        return {
            k: prune(v, keep)
            for k, v in tree.items()
            if not (isinstance(v, dict) and TENSOR in v and v[TENSOR] not in keep)
        }
    return tree


def leaves(tree: Json, path: str = "") -> Iterator[tuple[str, Any]]:
    """The non-tensor values of an encoded tree, for display: ``(path, value)``, with
    dicts (unless short) and anything holding tensors opened up."""
    value = decode(tree, {}) if tensor_keys(tree) == [] else None
    if value is not None and (not isinstance(value, dict) or len(repr(value)) <= 60):
        yield path, value
    elif isinstance(tree, dict) and ITEMS in tree:
        for key, value in tree[ITEMS]:
            yield from leaves(value, f"{path}/{key}")
    elif isinstance(tree, dict) and TENSOR not in tree:
        items = tree.get(TUPLE, tree)
        pairs = enumerate(items) if isinstance(items, list) else items.items()
        for key, value in pairs:
            yield from leaves(value, f"{path}/{key}" if path else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{path}/{i}")
