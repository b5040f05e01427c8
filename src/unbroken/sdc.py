"""Silent data corruption: data-parallel replicas that should be identical but are not.

Every save gathers each rank's block checksums (`unbroken.format.write_plan`): a region
(same tensor, same offsets) that several ranks hold is hashed before anything is written,
so comparing the copies is dictionary work on what the save already has. Ranks may
legitimately hold different values under one key (RNG streams, data positions, per-rank
counters, BatchNorm running statistics: the manifest then tags each value with its
``Chunk.ranks``), so only state that must be replicated is compared:

- what unbroken *knows* to be replicated (`known`, on by default): the parameters of
  modules wrapped by `DistributedDataParallel` (a wrapper in the state, one inside an
  entry, or one around an entry that ran once the Checkpointer existed) but not those
  DDP is told to ignore, nor buffers (DDP re-broadcasts them at the start of each
  forward, and the forward then updates BatchNorm's running statistics from each rank's
  own batch); the optimizer state of those parameters; and every DTensor replicated on
  a mesh dimension and ``Partial`` on none (the replica dimension of HSDP: the replica
  groups' copies of a shard hold equal offsets);
- and the top-level entries the user names in `Replicated` (``("model", "optim")``), for
  replicated state unbroken cannot recognise (a model replicated by hand).

The rule: every such region held by two or more ranks has one checksum. Sharded tensors
(FSDP, tensor parallel) hold different regions and are never compared. The cost: a walk
of the modules' parameters when a save captures the state, then, in the background, one
pass over the checksums the plan gathered anyway (nothing at all where nothing is known).

A divergent region is named with its tensor, region and which ranks hold which value, is
recorded as an ``sdc`` event (`unbroken.run.worker.event`), and then ``action`` decides:
``"warn"`` logs and saves, ``"refuse"`` fails the save on every rank before it commits
(`SilentCorruptionError`; what the ranks wrote is removed), ``"suspect"`` (the default)
saves, logs, and writes ``suspect.json`` beside the step's manifest, which `suspect`
reads back (a restore of the step warns, ``unbroken show`` prints ``SUSPECT``). The
manifest itself is unchanged. The comparison runs once every rank has written, after
each has judged its overlapped copy (`unbroken.job.overlap`): a copy torn by the loop
fails its save as torn, never as a divergent replica.

Why ``"suspect"`` by default: a replica that differs is a fault to say loudly, but not a
reason to stop checkpointing. Refusing loses the newest restore point while training goes
on with the divergent replica anyway (a false alarm would stop every save of a healthy
job); a suspect step keeps every rank's values as they were (tagged, never replaced by
rank 0's copy), which is both the evidence and a restore point, and whoever restores it
is told. Jobs that would rather stop choose ``Replicated(action="refuse")``;
``Replicated(auto=False)`` turns the automatic comparison off.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from unbroken.errors import CheckpointError
from unbroken.format.blockio import start
from unbroken.format.layout import step_dir
from unbroken.format.marks import SUSPECT, report, suspect
from unbroken.format.write_plan import Block
from unbroken.run.worker import event
from unbroken.state import param_indices

__all__ = [
    "SUSPECT", "Divergence", "Known", "Replicated", "SilentCorruptionError", "report", "suspect",
]  # fmt: skip

log = logging.getLogger(__name__)


class SilentCorruptionError(CheckpointError):
    """Replicas that must be identical differ between ranks (``Replicated(action="refuse")``)."""


@dataclass(frozen=True)
class Divergence:
    """One region of one tensor whose copies differ: ``values`` maps each checksum to the
    ranks holding it."""

    key: str
    offsets: tuple[int, ...]
    values: dict[str, list[int]]

    def describe(self) -> str:
        held = "; ".join(f"ranks {r} hold {x}" for x, r in self.values.items())
        return f"tensor {self.key!r} at offsets {list(self.offsets)}: {held}"


@dataclass(frozen=True)
class Known:
    """The captured keys of one state that unbroken knows to be replicated (`known`):
    ``keys`` of parameters DDP keeps in sync (``"model/module.0.weight"``), the
    per-parameter state of their optimizers (``"optim/state/3"`` and below), and any
    DTensor replicated on a mesh dimension and ``Partial`` on none."""

    keys: frozenset[str] = frozenset()
    optimizer_state: frozenset[str] = frozenset()

    def holds(self, key: str, t: torch.Tensor) -> bool:
        if isinstance(t, DTensor):  # Partial: each rank holds an addend, not a copy
            placements = t.placements
            return any(p.is_replicate() for p in placements) and not any(
                p.is_partial() for p in placements
            )
        return key in self.keys or (
            bool(self.optimizer_state) and "/".join(key.split("/", 3)[:3]) in self.optimizer_state
        )


def known(state: Mapping[str, Any], wrappers: Mapping[str, nn.Module]) -> Known:
    """What ``state`` holds that is replicated by construction; ``wrappers`` are the DDP
    wrappers of its entries that a forward showed (`unbroken.healing.ddp_buckets.Tracker`:
    the usual ``state = {"model": model}`` with ``DDP(model)`` used for training). A walk
    of the modules' parameters and the optimizers' groups, no tensor touched."""
    synced: set[int] = set()  # ids of the parameters DDP keeps equal
    for name, value in state.items():
        if isinstance(value, nn.Module):
            wrapper = value if isinstance(value, DistributedDataParallel) else wrappers.get(name)
            ddps = (
                [wrapper]
                if isinstance(wrapper, DistributedDataParallel)
                else [m for m in value.modules() if isinstance(m, DistributedDataParallel)]
            )
            for ddp in ddps:
                ignored = getattr(ddp, "parameters_to_ignore", ())
                synced.update(
                    id(p)
                    for n, p in ddp.module.named_parameters(remove_duplicate=False)
                    if n not in ignored
                )
    if not synced:
        return Known()
    keys: set[str] = set()
    optimizer_state: set[str] = set()
    for name, value in state.items():
        if isinstance(value, nn.Module):
            named = value.named_parameters(remove_duplicate=False)
            keys.update(f"{name}/{n}" for n, p in named if id(p) in synced)
        elif isinstance(value, Optimizer):
            index = param_indices(value).items()
            optimizer_state.update(f"{name}/state/{i}" for q, (i, _) in index if q in synced)
    return Known(frozenset(keys), frozenset(optimizer_state))


@dataclass(frozen=True)
class Replicated:
    """Which state every data-parallel rank must hold identically, and what a save does
    when it does not (see the module docstring for the rule and the default).

    ``names``: top-level state entries to compare besides what unbroken knows to be
    replicated. ``auto``: compare what it knows (DDP parameters and their optimizer
    state, DTensor replicas); ``Replicated(auto=False)`` with no names checks nothing.
    """

    names: tuple[str, ...] = ()
    action: Literal["warn", "refuse", "suspect"] = "suspect"
    auto: bool = True

    def __post_init__(self) -> None:
        if self.action not in ("warn", "refuse", "suspect"):
            raise ValueError(
                f"Replicated action {self.action!r}: choose 'warn', 'refuse' or 'suspect'"
            )
        if not isinstance(self.names, tuple) or any(
            not isinstance(n, str) or not n or "/" in n for n in self.names
        ):
            raise ValueError(
                f"Replicated names {self.names!r}: give a tuple of top-level state names "
                "such as ('model', 'optim')"
            )
        if not isinstance(self.auto, bool):
            raise ValueError(f"Replicated auto={self.auto!r}: True or False")

    def known(self, state: Mapping[str, Any], wrappers: Mapping[str, nn.Module]) -> Known | None:
        """`known` of ``state``, or None when ``auto`` is off."""
        return known(state, wrappers) if self.auto else None

    def compares(self, known_by_rank: list[Any] | None) -> bool:
        """Whether `check` compares anything: some names, or state known replicated."""
        return bool(self.names) or (self.auto and any(known_by_rank or []))

    def divergent(
        self, blocks_by_rank: Sequence[Sequence[Block]], known_by_rank: list[Any] | None = None
    ) -> list[Divergence]:
        """The regions compared (under ``names``, and those ``known_by_rank`` lists: the
        indices of each rank's blocks it knows to be replicated) whose checksums differ
        between the ranks that compare them."""
        seen: dict[tuple[str, tuple[int, ...]], dict[str, list[int]]] = {}
        for rank, blocks in enumerate(blocks_by_rank):
            mine = known_by_rank[rank] if self.auto and known_by_rank else []
            for b in self._compared(blocks, mine):
                seen.setdefault((b.key, b.offsets), {}).setdefault(b.xxh3, []).append(rank)
        return [
            Divergence(key, offsets, values)
            for (key, offsets), values in sorted(seen.items())
            if len(values) > 1
        ]

    def _compared(self, blocks: Sequence[Block], mine: Any) -> list[Block]:
        picked: set[int] = set()
        if isinstance(mine, list):  # from a peer: only indices of its own blocks count
            picked.update(i for i in mine if type(i) is int and 0 <= i < len(blocks))
        if self.names:
            picked.update(i for i, b in enumerate(blocks) if b.key.split("/", 1)[0] in self.names)
        return [blocks[i] for i in sorted(picked)]

    def check(
        self,
        step: int,
        blocks_by_rank: Sequence[Sequence[Block]],
        rank: int,
        known_by_rank: Any = None,
    ) -> list[Divergence]:
        """Run at save time on every rank with the same gathered blocks (so every rank
        decides alike): record and act; returns what diverged for ``"suspect"``."""
        found = self.divergent(blocks_by_rank, known_by_rank)
        if not found:
            return []
        what = "; ".join(d.describe() for d in found[:5])
        more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
        if rank == 0:
            for d in found:
                event("sdc", step=step, tensor=d.key, offsets=list(d.offsets),
                      values=d.values, action=self.action)  # fmt: skip
        message = (
            f"step {step}: data-parallel replicas differ (silent data corruption?): {what}{more}"
        )
        advice = (
            "Check the hardware of the ranks in the minority, or restore the last good "
            "checkpoint. If this state may legitimately differ between ranks, compare only "
            "what you name: Replicated(names=(...), auto=False)"
        )
        if self.action == "refuse":
            raise SilentCorruptionError(f"{message}; the save is refused. {advice}")
        if rank == 0:
            kept = "saved and marked suspect" if self.action == "suspect" else "saved anyway"
            log.warning("%s; %s. %s", message, kept, advice)
        return found if self.action == "suspect" else []


def record(found: list[Divergence]) -> bytes:
    """The ``suspect.json`` of a step saved with divergent replicas."""
    rows = [{"tensor": d.key, "offsets": list(d.offsets), "values": d.values} for d in found]
    return json.dumps({"suspect": "replicas differ", "divergent": rows}).encode()


def guard(
    replicated: Replicated | None,
    rank: int,
    storage: object,
    step: int,
    blocks: Sequence[Sequence[Block]],
    known_by_rank: list[Any] | None = None,
) -> None:
    """The save's check (one call from `unbroken.saving.pipeline`): rank 0 writes ``suspect.json``
    into the step's folder before the manifest commits it."""
    if replicated is None:
        return
    found = replicated.check(step, blocks, rank, known_by_rank)
    if found and rank == 0:
        storage.write(f"{step_dir(step)}/{SUSPECT}", [record(found)])  # type: ignore[attr-defined]


def restoring(storage: object, step: int) -> Callable[[], None]:
    """A restore of ``step`` from ``storage`` begins: its suspect mark is read now, beside
    the restore's own reads (one round trip off the restore's path). Call what this
    returns once the restore stood: if the step was saved as suspect, it says so (warning
    and event); the restore stands, as the save did."""
    marked = start(lambda: _mark(storage, step))

    def restored() -> None:
        line = marked.result()
        if line is not None:
            log.warning(
                "restore: %s; restored anyway. Unless the difference is expected, restore an "
                "earlier step (`unbroken ls`, `restore(state, step=N)`)",
                line,
            )
            event("suspect_restored", step=step, report=line[:500])

    return restored


def _mark(storage: object, step: int) -> str | None:
    try:
        return report(storage, step)
    # A damaged or forged mark, or a storage error: said, never raised (only rank 0
    # reads it, so an error would fail a restore the other ranks finished)
    except Exception as e:
        return f"step {step}: its {SUSPECT} is unreadable ({e})"
