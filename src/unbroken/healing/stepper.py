"""The per-step side of a Checkpointer: records for healing (`Checkpointer.step`) and DDP
bucket layouts (`unbroken.healing.ddp_buckets`), both carried from one generation or restart to the
next. The facade keeps the public methods; this keeps their state and the collectives
they need at restore."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from unbroken.errors import CheckpointError
from unbroken.healing import ddp_buckets, live, records
from unbroken.healing.records import Record
from unbroken.job.comm import Comm
from unbroken.memory.tier import MemoryTier
from unbroken.restoring.sources import Restored
from unbroken.state import Captured

log = logging.getLogger("unbroken")

LAYOUTS_FILE = "ddp-layouts.json"  # in a rank's shared-memory folder, for restart-all


class Stepper:
    """Per-step records of rank ``comm.rank`` of ``job``, sent to ``partners`` and
    received from ``sources`` (ranks on other nodes where there are any)."""

    def __init__(self, comm: Comm, job: str, partners: list[int], sources: list[int]) -> None:
        self.comm, self.job = comm, job
        self.partners, self.sources = partners, sources
        self.tracker = ddp_buckets.Tracker()
        self._noted: dict[str, ddp_buckets.Layout] | None = None

    def record(self, step: int, state: Mapping[str, Any], memory: MemoryTier | None) -> Record:
        """Make and keep this rank's record of ``step`` (the caller sends it on)."""
        layouts = self.observe(state, memory)
        data_parallel = self.tracker.covered(state)
        record = Record.make(
            step, self.comm.rank, state, layouts=layouts, data_parallel=data_parallel
        )
        records.keep_own(self.job, record)
        return record

    def exchange(self, record: Record) -> None:
        """Send ``record`` to the partners and keep the records the sources send, on the
        caller's thread: when `Checkpointer.step` returns, the peer holds this step's
        record, so a rank that dies later can be healed at this step. Point-to-point
        with one or two partners (one round trip, tag `records.TAG`, concurrent with
        the worker's replica traffic), never a collective. A failed peer fails it like
        a collective: `CheckpointError`."""
        try:
            got = records.exchange(
                self.comm, dict.fromkeys(self.partners, record.data), self.sources
            )
        except RuntimeError as e:  # gloo: the peer is gone, or the group was aborted
            raise CheckpointError(
                f"sending the step record of step {record.step} failed ({e}): a peer failed"
            ) from e
        for owner, data in got.items():
            received = Record.decode(data, f"rank {owner}")
            records.keep_held(self.job, owner, received.step, data)

    def observe(self, state: Mapping[str, Any], memory: MemoryTier | None) -> dict[str, Any]:
        """The DDP layouts of ``state``'s wrappers, noted in shared memory when new
        (restart-all finds them there); stops watching for new wrappers."""
        layouts = self.tracker.layouts(state)
        self.tracker.settle(state)
        if layouts and layouts != self._noted and memory is not None:
            path = os.path.join(memory.dir, LAYOUTS_FILE)
            with open(f"{path}.tmp", "w") as f:
                json.dump({"job": self.job, "layouts": layouts}, f)
            os.replace(f"{path}.tmp", path)
            self._noted = layouts
        return layouts

    def heal(self, state: MutableMapping[str, Any], captured: Captured) -> Restored | None:
        """`live.heal`: live state, or None for the snapshot path. Collective."""
        healed = live.heal(self.comm, self.job, state, captured)
        return None if healed is None else healed[0]

    def agree_layouts(self, state: Mapping[str, Any], memory: MemoryTier | None) -> None:
        """Every rank proposes the layouts it knows (its record, a record it holds, its
        shared memory); all take the first proposal in rank order, so the wrappers of
        every rank get the same layout or none. Collective."""
        proposal = self._known(memory)
        chosen = next((p for p in self.comm.all_gather(proposal) if p), None)
        if chosen:
            self.tracker.owe(state, chosen)

    def _known(self, memory: MemoryTier | None) -> dict[str, Any] | None:
        mine = records.own(self.job, self.comm.rank)
        if mine is not None and mine.header.get("layouts"):
            return dict(mine.header["layouts"])
        for steps in records.held(self.job).values():
            for data in steps.values():
                layouts = Record.decode(data, "a held record").header.get("layouts")
                if layouts:
                    return dict(layouts)
        if memory is not None:
            try:
                with open(os.path.join(memory.dir, LAYOUTS_FILE)) as f:
                    noted = json.load(f)
                if noted.get("job") == self.job and isinstance(noted.get("layouts"), dict):
                    return dict(noted["layouts"])
            except (OSError, ValueError):
                pass
        return None

    def stop(self) -> None:
        self.tracker.stop()
