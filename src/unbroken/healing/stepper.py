"""The per-step side of a Checkpointer: records for healing (`Checkpointer.step`) and DDP
bucket layouts (`unbroken.healing.ddp_buckets`), both carried from one generation or restart to the
next. The facade keeps the public methods; this keeps their state and the collectives
they need at restore."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from unbroken.access import read_own
from unbroken.errors import CheckpointError
from unbroken.healing import ddp_buckets, live, messages, records
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
            text = json.dumps({"job": self.job, "layouts": layouts})
            memory.access.write_text(f"{path}.tmp", text)  # never through a planted link
            os.replace(f"{path}.tmp", path)
            self._noted = layouts
        return layouts

    def heal(self, state: MutableMapping[str, Any], captured: Captured) -> Restored | None:
        """`live.heal`: live state, or None for the snapshot path. Collective."""
        healed = live.heal(self.comm, self.job, state, captured)
        return None if healed is None else healed[0]

    def agree_layouts(self, state: Mapping[str, Any], memory: MemoryTier | None) -> None:
        """Every rank proposes the layouts it knows (its record, a record it holds, its
        shared memory); all take the first proposal in rank order that fits the state, so
        the wrappers of every rank get the same layout or none. A malformed one (from a
        file or a peer) is passed over with a warning: it never breaks a restore.
        Collective."""
        proposals = self.comm.all_gather(self._known(state, memory))
        for rank, proposal in enumerate(proposals):
            chosen = _fitting(proposal, state, f"the DDP layouts rank {rank} proposed")
            if chosen:
                self.tracker.owe(state, chosen)
                return

    def _known(self, state: Mapping[str, Any], memory: MemoryTier | None) -> Layouts | None:
        for raw, where in self._candidates(memory):
            layouts = _fitting(raw, state, where)
            if layouts:
                return layouts
        return None

    def _candidates(self, memory: MemoryTier | None) -> Iterator[tuple[Any, str]]:
        """The layouts this rank knows of, unchecked, each with where it came from."""
        mine = records.own(self.job, self.comm.rank)
        if mine is not None:
            yield mine.header.get("layouts"), f"the DDP layouts of this rank's step {mine.step}"
        for owner, steps in records.held(self.job).items():
            for step, data in steps.items():
                layouts = Record.decode(data, f"rank {owner}").header.get("layouts")
                yield layouts, f"the DDP layouts in rank {owner}'s step record of step {step}"
        if memory is not None:
            path = os.path.join(memory.dir, LAYOUTS_FILE)
            try:
                yield _noted(path, self.job), path
            except ValueError as e:
                log.warning("ignoring %s: %s (not a DDP bucket layout of this job)", path, e)

    def stop(self) -> None:
        self.tracker.stop()


Layouts = dict[str, ddp_buckets.Layout]


def _fitting(raw: Any, state: Mapping[str, Any], where: str) -> Layouts | None:
    """``raw`` as layouts if it is some and fits ``state``, else None (with a warning
    naming ``where`` if it is malformed)."""
    if not raw:
        return None
    try:
        return ddp_buckets.check_layouts(raw, state)
    except ValueError as e:
        log.warning("ignoring %s: %s (not a DDP bucket layout of this state)", where, e)
        return None


def _noted(path: str, job: str) -> Any:
    """The layouts noted in the shared-memory file ``path`` for ``job`` (unchecked), None
    if there is none; ValueError if it is not a file `Stepper.observe` wrote."""
    try:
        data = read_own(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"it cannot be read ({e})") from None
    noted = messages.json_object(data)
    if "layouts" not in noted:
        raise ValueError("it names no layouts")
    return noted["layouts"] if noted.get("job") == job else None
