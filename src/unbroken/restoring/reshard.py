"""Restoring onto a different number of ranks: which saved state each new rank gets.

Tensors need no rule: every stored block records where it sits in the global tensor,
so each rank reads the overlap of the blocks with the part it holds, whatever the
number of ranks that wrote them (`unbroken.format.shards.fill`).

Per-rank state (RNG streams, data positions, per-rank tensors) has no such coordinate.
The rule, applied to each top-level state entry when the world size changed:

1. an entry every saved rank saved identically (a model, an optimizer, a step counter)
   is restored on every new rank;
2. an entry that differs between the saved ranks is refused, naming it, unless the live
   state wraps it in `PerRank`, whose ``on_reshard`` says what to do: ``"keep"`` each
   rank's live value, or a function that computes each new rank's value from all saved
   ranks' values.

So nothing is silently dropped (saved ranks beyond the new world) or duplicated (one
saved rank's data position handed to two new ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

from unbroken.errors import CheckpointError
from unbroken.format.layout import Manifest
from unbroken.state import capture
from unbroken.tree import decode, tensor_keys

log = logging.getLogger("unbroken")

# on_reshard(saved, rank, world_size) -> the state_dict this rank loads; ``saved`` holds
# every saved rank's state_dict, in rank order.
Redistribute = Callable[[list[Any], int, int], Any]


class PerRank:
    """A `Stateful` whose saved value differs between ranks, with what a restore onto a
    different number of ranks does with it.

    >>> state["rng"] = PerRank(RNGState(), on_reshard="keep")
    >>> state["data"] = PerRank(loader, on_reshard=lambda saved, rank, world: ...)

    ``on_reshard``: ``"refuse"`` (the default: the restore fails, naming the entry),
    ``"keep"`` (each rank keeps its live value; the saved ones are not used), or a
    function ``(saved, rank, world_size) -> state_dict`` that gets every saved rank's
    state_dict (JSON values; per-rank tensors are refused) and returns this rank's.
    With the same number of ranks, rank r restores saved rank r's value as always.
    """

    def __init__(
        self, value: Any, on_reshard: Literal["refuse", "keep"] | Redistribute = "refuse"
    ) -> None:
        if not (callable(on_reshard) or on_reshard in ("refuse", "keep")):
            raise ValueError(
                f"on_reshard={on_reshard!r}: choose 'refuse', 'keep' or a function "
                "(saved, rank, world_size) -> state_dict"
            )
        self.value, self.on_reshard = value, on_reshard

    def state_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = self.value.state_dict()
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"PerRank({self.value!r}, on_reshard={self.on_reshard!r})"


def saved_objects(
    where: str, manifest: Manifest, state: Mapping[str, Any], rank: int, world_size: int
) -> tuple[dict[str, Any], set[str]]:
    """The saved tree (entry -> encoded value) rank ``rank`` of ``world_size`` restores,
    and the entries it leaves as they are (``on_reshard="keep"``)."""
    if manifest.world_size == world_size:
        return manifest.objects_for(rank), set()
    trees = [manifest.objects_for(r) for r in range(manifest.world_size)]
    per_rank_tensors = {
        key.split("/", 1)[0]
        for key, entry in manifest.tensors.items()
        if any(c.ranks is not None for c in entry.chunks)
    }
    chosen: dict[str, Any] = {}
    kept: set[str] = set()
    for name in sorted({n for tree in trees for n in tree}):
        values = [tree.get(name) for tree in trees]
        holders = [r for r, tree in enumerate(trees) if name in tree]
        same = len(holders) == len(trees) and all(v == values[0] for v in values)
        if same and name not in per_rank_tensors:
            chosen[name] = values[0]
            continue
        target = state.get(name)
        policy = target.on_reshard if isinstance(target, PerRank) else "refuse"
        if name not in state:
            chosen[name] = values[holders[0]]  # not restored here; `strict` reports it
        elif policy == "keep":
            kept.add(name)
            log.info("%s: keeping the live %r on rank %d (PerRank on_reshard='keep')",
                     where, name, rank)  # fmt: skip
        elif policy == "refuse":
            raise CheckpointError(_refusal(where, manifest, world_size, name, values, holders))
        elif name in per_rank_tensors or any(tensor_keys(v) for v in values):
            raise CheckpointError(
                f"{where}: state entry {name!r} holds tensors and differs between the "
                f"{manifest.world_size} saved ranks; an on_reshard function gets JSON "
                "values only. Use on_reshard='keep', or restore on "
                f"{manifest.world_size} ranks"
            )
        else:
            chosen[name] = _redistribute(where, name, policy, values, rank, world_size)
    return chosen, kept


def _refusal(
    where: str, manifest: Manifest, world: int, name: str, values: list[Any], holders: list[int]
) -> str:
    if len(holders) < len(values):
        how = f"only saved ranks {holders} hold it"
    else:
        distinct = len({repr(v) for v in values})
        how = f"it holds {distinct} different values (or per-rank tensors) among them"
    return (
        f"{where} was saved by {manifest.world_size} ranks and this job has {world}: "
        f"state entry {name!r} is per-rank ({how}), and restoring it onto {world} ranks "
        "would drop or duplicate some. Say what to do by wrapping it: "
        f"state[{name!r}] = unbroken.PerRank(obj, on_reshard='keep') keeps each rank's live "
        "value; on_reshard=fn(saved, rank, world_size) computes each rank's from all "
        f"saved values. Or restore on {manifest.world_size} ranks."
    )


def _redistribute(
    where: str, name: str, fn: Redistribute, values: list[Any], rank: int, world: int
) -> Any:
    """Call the user's function with decoded values; its result, encoded for `decode`."""
    saved = [decode(v, {}) if v is not None else None for v in values]
    result = fn(saved, rank, world)
    try:
        tensors, tree = capture({name: result})
    except CheckpointError as e:
        raise CheckpointError(f"{where}: on_reshard of {name!r} returned {e}") from None
    if tensors or tensor_keys(tree[name]):
        raise CheckpointError(f"{where}: on_reshard of {name!r} returned tensors; return JSON")
    return tree[name]
