"""A save's plan, made on rank 0 alone: every other rank receives only its own part.

Each rank sends rank 0 what it saves (`Comm.planned`); rank 0 decodes every rank's
blocks, finds the regions several ranks hold (hashed before the plan, see
`unbroken.saving.checksums`), then, with their checksums, makes the write plan
(`unbroken.format.write_plan.make_plan`) and compares the replicated state
(`unbroken.sdc`). The other ranks get back the keys to hash first, then the keys to
write, and never see another rank's blocks: a save's metadata costs them O(their
blocks), and rank 0 O(every block) once, instead of every rank doing rank 0's work
(docs/scaling.md). What makes every rank refuse the save travels in the parts, so every
rank raises the same error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import CheckpointError
from unbroken.format.layout import Manifest
from unbroken.format.write_plan import Block, WritePlan, make_plan
from unbroken.job.gc_paused import building
from unbroken.saving.checksums import Sums, shared, with_checksums
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
    and run on rank 0 only. ``storage`` receives the step's suspect mark (`sdc.guard`)."""

    step: int
    replicated: Replicated | None
    storage: object
    by_rank: list[list[Block]] = field(default_factory=list)
    known: list[Any] = field(default_factory=list)  # each rank's replicated block indices
    plan: WritePlan | None = None
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
        with building():  # every rank's blocks: hundreds of thousands at scale
            self.by_rank = [[Block.from_json(b) for b in row[2]] for row in rows]
            early = shared(self.by_rank)
        self.known = [row[3] if len(row) > 3 else [] for row in rows]
        return [[None, False, keys] for keys in early]

    def writes(self, sums: list[Sums]) -> list[Any]:
        """From every rank's checksums of its early keys, the plan; each rank's
        ``[refusal, keys it writes]``. Replicated state that diverged is named here
        (`unbroken.sdc`): a refused save is refused on every rank."""
        with building():
            self.by_rank = with_checksums(self.by_rank, sums)
            self.plan = make_plan(self.by_rank)
        try:
            guard(self.replicated, 0, self.storage, self.step, self.by_rank, self.known)
        except SilentCorruptionError as e:
            return [[["SilentCorruptionError", str(e)], []]] * len(sums)
        return [[None, keys] for keys in self.plan.writes]

    def wrote(self, rows: list[Any]) -> list[None]:
        """Keeps where every rank wrote its blocks, for the commit; nothing goes back."""
        self.written = rows
        return [None] * len(rows)

    def manifest(self, world: int, created: float) -> Manifest:
        """The step's manifest: the plan, with where every rank wrote its blocks and the
        checksums it took meanwhile; the per-rank trees stored once each."""
        assert self.plan is not None
        files: dict[str, int] = {}
        trees: dict[str, int] = {}  # each distinct tree (as JSON) -> its index
        objects: list[dict[str, Any]] = []
        rank_objects: list[int] = []
        for rank, (where, rank_sizes, rank_tree, sums) in enumerate(self.written):
            files.update(rank_sizes)
            for key, (file, start, end) in where.items():
                chunk = self.plan.chunk_of[rank, key]
                chunk.file, chunk.start, chunk.end = file, start, end
                for name, value in sums.get(key, {}).items():  # hashed while it was written
                    setattr(chunk, name, value)  # `format.Checksums`' fields are `Chunk`'s
            text = json.dumps(rank_tree, sort_keys=True)
            if text not in trees:
                trees[text] = len(objects)
                objects.append(rank_tree)
            rank_objects.append(trees[text])
        return Manifest(
            step=self.step, world_size=world, created=created, tensors=self.plan.tensors,
            objects=objects, rank_objects=rank_objects, files=files,
        )  # fmt: skip
