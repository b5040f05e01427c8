"""Who keeps replicas of whose snapshots: pure functions of the ranks' nodes."""

from __future__ import annotations

from collections.abc import Sequence


def partners(nodes: Sequence[str], rank: int, copies: int) -> list[int]:
    """The ranks that keep replicas of ``rank``'s snapshots: the rank with the same local
    index on each of the next ``copies`` nodes. Replicas land on another node whenever
    there is more than one; on a single node they go to other ranks of it. Pure:
    ``nodes[r]`` names rank r's node."""
    return _Nodes(nodes).partners(rank, copies)


def replica_layout(nodes: Sequence[str], rank: int, copies: int) -> tuple[list[int], list[int]]:
    """The ranks that keep replicas of ``rank``'s snapshots (see `partners`), and those
    whose snapshots ``rank`` keeps replicas of. Pure: ``nodes[r]`` names rank r's node.
    O(world * copies): it runs on every rank of a job of thousands."""
    layout = _Nodes(nodes)
    keeps = [r for r in range(len(nodes)) if rank in layout.partners(r, copies)]
    return layout.partners(rank, copies), keeps


class _Nodes:
    """Ranks by node, computed once: `partners` is then O(copies)."""

    def __init__(self, nodes: Sequence[str]) -> None:
        self.nodes = nodes
        self.order = list(dict.fromkeys(nodes))
        self.position = {node: i for i, node in enumerate(self.order)}
        self.ranks_on: dict[str, list[int]] = {node: [] for node in self.order}
        self.index: list[int] = []
        for r, node in enumerate(nodes):
            self.index.append(len(self.ranks_on[node]))
            self.ranks_on[node].append(r)

    def partners(self, rank: int, copies: int) -> list[int]:
        world = len(self.nodes)
        if len(self.order) == 1:
            return [(rank + j) % world for j in range(1, 1 + min(copies, world - 1))]
        mine = self.position[self.nodes[rank]]
        chosen = []
        for j in range(1, 1 + min(copies, len(self.order) - 1)):
            peers = self.ranks_on[self.order[(mine + j) % len(self.order)]]
            chosen.append(peers[self.index[rank] % len(peers)])
        return chosen
