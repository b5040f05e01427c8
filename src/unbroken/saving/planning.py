"""A save's plan, made on rank 0 alone: every other rank receives only its own part.

Each rank sends rank 0 what it saves (`Comm.planned`); rank 0 surveys every rank's
blocks (`unbroken.format.write_plan.survey`: the regions several ranks hold are hashed
before the plan, see `unbroken.saving.checksums`), then, with their checksums, makes the
write plan (`write_plan.make_plan`); once every rank has written, it compares the
replicated state (`unbroken.sdc`).
The other ranks get back the keys to hash first, then the keys to write, and never see
another rank's blocks; each encodes the manifest chunks of what it wrote, which rank 0
joins into the manifest: a save's metadata costs them O(their
blocks), and rank 0 O(every block) once, instead of every rank doing rank 0's work
(docs/scaling.md). What makes every rank refuse the save travels in the parts, so every
rank raises the same error.
"""

from __future__ import annotations

import itertools
import json
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, overload

from unbroken.errors import CheckpointError
from unbroken.format.layout import Encoded, Manifest, TensorEntry, joined
from unbroken.format.write_plan import Block, Order, Row, Survey, WritePlan, make_plan, survey
from unbroken.job.gc_paused import building
from unbroken.saving.checksums import Sums
from unbroken.sdc import Replicated, SilentCorruptionError, guard

log = logging.getLogger("unbroken")

# A refusal, as a part carries it: its error's class and message.
_REFUSALS: dict[str, type[CheckpointError]] = {
    "CheckpointError": CheckpointError,
    "SilentCorruptionError": SilentCorruptionError,
}


def refused(refusal: list[str] | None) -> None:
    """Raise the refusal a part carries, if any: the same error on every rank."""
    if refusal is not None:
        kind, message = refusal
        raise _REFUSALS[kind](message)


@dataclass(kw_only=True)
class Planner:
    """Rank 0's side of one save's exchanges; its methods are ``Comm.planned``'s plans
    and run on rank 0 only. ``storage`` receives the step's suspect mark (`sdc.guard`).

    It reads every rank's blocks as they arrive (`Block.to_json` rows), keeps of them
    only their regions (`write_plan.Survey`), and builds no object per block (2,304
    ranks x 100 tensors: 230,400 blocks, issue 33): the writers encode their own
    manifest chunks, joined here (`layout.joined`)."""

    step: int
    replicated: Replicated | None
    storage: object
    surveyed: Survey | None = None
    rows: list[list[Row]] = field(default_factory=list)  # every block, if sdc compares any
    known: list[Any] = field(default_factory=list)  # each rank's replicated block indices
    plan: WritePlan | None = None
    sums: list[Sums] = field(default_factory=list)  # every rank's early checksums
    written: list[Any] = field(default_factory=list)  # each rank's write row, for the commit

    def layout(self, rows: list[Any]) -> list[Any]:
        """From every rank's ``[step, skipped, blocks, replicated]`` (`pipeline._layout`),
        each rank's ``[refusal, skipped, keys to hash before the plan]``."""
        world = len(rows)
        if skippers := [rank for rank, row in enumerate(rows) if row[1]]:
            log.warning(
                "step %d skipped: the previous save was still persisting on ranks %s",
                self.step,
                skippers,
            )
            return [[None, True, []]] * world
        steps = [row[0] for row in rows]
        if len(set(steps)) > 1:
            refusal = ["CheckpointError", (
                f"ranks disagree on the step to save: {dict(enumerate(steps))}; "
                "every rank must call save() with the same step"
            )]  # fmt: skip
            return [[refusal, False, []]] * world
        with building():  # a tuple per block (its region), a list per shared one
            self.surveyed = survey([row[2] for row in rows])
        self.known = [row[3] if len(row) > 3 else [] for row in rows]
        if self.replicated is not None and self.replicated.compares(self.known):
            self.rows = [row[2] for row in rows]  # else dropped now: see `Comm.planned`
        return [[None, False, keys] for keys in self.surveyed.early]

    def writes(self, sums: list[Sums]) -> list[Any]:
        """From every rank's checksums of its early keys, the plan; each rank's
        ``[keys it writes, {key: ranks} for the chunks that name them]``."""
        assert self.surveyed is not None
        with building():
            self.plan = make_plan(self.surveyed, sums)
        self.sums = sums
        plan = self.plan
        return [[keys, tags] for keys, tags in zip(plan.writes, plan.tags, strict=True)]

    def wrote(self, rows: list[Any]) -> list[Any]:
        """Keeps what every rank wrote (`pipeline._write`), for the commit, then compares
        the replicated state (`unbroken.sdc`): only now, once every rank has found its
        overlapped copy intact, so that a torn copy fails its save as torn, never as a
        divergent replica. Each rank's refusal, or None: a refused save is refused on
        every rank, and what they wrote is removed."""
        self.written = rows
        try:
            blocks = (
                [_Blocks(r, s) for r, s in zip(self.rows, self.sums, strict=True)]
                if self.rows
                else []
            )
            guard(self.replicated, 0, self.storage, self.step, blocks, self.known)
        except SilentCorruptionError as e:
            return [["SilentCorruptionError", str(e)]] * len(rows)
        return [None] * len(rows)

    def manifest(self, world: int, created: float) -> Encoded:
        """The step's manifest: each tensor's chunks as their writers encoded them, in
        the plan's order; the per-rank trees stored once each."""
        assert self.plan is not None
        plan, files = self.plan, {}
        trees: dict[str, int] = {}  # each distinct tree (as JSON) -> its index
        objects: list[dict[str, Any]] = []
        rank_objects: list[int] = []
        orders: dict[str, list[Order]] = {key: [] for key in plan.tensors}
        texts: dict[str, list[str]] = {key: [] for key in plan.tensors}
        with building():
            for rank, (encoded, rank_sizes, rank_tree) in enumerate(self.written):
                files.update(rank_sizes)
                for order, text in zip(plan.order[rank], encoded, strict=True):
                    orders[key := order[0]].append(order)  # an order begins with its key
                    texts[key].append(text)
                tree = json.dumps(rank_tree, sort_keys=True)
                if tree not in trees:
                    trees[tree] = len(objects)
                    objects.append(rank_tree)
                rank_objects.append(trees[tree])
            chunks = {key: _sorted(texts[key], orders[key]) for key in texts}
        for key, original in plan.aliases.items():  # both keys name the same bytes
            chunks[key] = chunks[original]
        tensors = {key: TensorEntry(dtype=d, shape=s) for key, (d, s) in plan.tensors.items()}
        header = Manifest(
            step=self.step, world_size=world, created=created, tensors=tensors,
            objects=objects, rank_objects=rank_objects, files=files,
        )  # fmt: skip
        return joined(header, chunks)


def _sorted(texts: list[str], orders: list[Order]) -> list[str]:
    """``texts`` in the order of ``orders``: as they are if they come in order already
    (a tensor sharded in rank order), else by sorted indices, not a tuple per chunk."""
    if all(map(operator.le, orders, itertools.islice(orders, 1, None))):
        return texts
    return [texts[i] for i in sorted(range(len(texts)), key=orders.__getitem__)]


class _Blocks(Sequence[Block]):
    """One rank's blocks as `unbroken.sdc` reads them, with the checksums it took before
    the plan: each decoded only when read (sdc compares only the replicated ones)."""

    def __init__(self, rows: list[Row], sums: Sums) -> None:
        self._rows, self._sums = rows, sums

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> Block: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Block]: ...
    def __getitem__(self, i: int | slice) -> Block | Sequence[Block]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        block = Block.from_json(self._rows[i])
        sums = self._sums.get(block.key)
        return replace(block, **sums) if sums else block
