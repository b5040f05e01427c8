"""The per-step side of a Checkpointer: records for healing (`Checkpointer.step`) and DDP
bucket layouts (`unbroken.healing.ddp_buckets`), both carried from one generation or restart to the
next. The facade keeps the public methods; this keeps their state and the collectives
they need at restore."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

from unbroken.access import read_own
from unbroken.errors import CheckpointError, PeerLostError
from unbroken.format.directory import Directory
from unbroken.format.layout import INFO, step_dir
from unbroken.healing import ddp_buckets, inflight, live, messages, records
from unbroken.healing.records import Record
from unbroken.job.comm import Comm, brief, lost_peer
from unbroken.memory.tier import MemoryTier
from unbroken.restoring.sources import Restored
from unbroken.run import faults
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
        # The step of the last record or restore; None until the job records steps.
        own = records.own(job, comm.rank)
        self.last: int | None = None if own is None else own.step
        self._prepared: int | None = None  # `last` when this rank last prepared a step
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle

    def record(self, step: int, state: Mapping[str, Any], memory: MemoryTier | None) -> Record:
        """Make and keep this rank's record of ``step`` (the caller sends it on)."""
        layouts = self.observe(state, memory)
        data_parallel = self.tracker.covered(state)
        record = Record.make(
            step, self.comm.rank, state, layouts=layouts, data_parallel=data_parallel,
            after=self.last,
        )  # fmt: skip
        records.keep_own(self.job, record)
        self.last = step
        self.hook(state)
        return record

    def hook(self, state: Mapping[str, Any]) -> None:
        """Have every optimizer of ``state`` prepare its step before applying it."""
        for value in state.values():
            if isinstance(value, Optimizer) and id(value) not in self._hooks:
                prepare = lambda *_: self.prepare(state)  # noqa: E731
                self._hooks[id(value)] = value.register_step_pre_hook(prepare)

    def prepare(self, state: Mapping[str, Any]) -> None:
        """`unbroken.healing.inflight`: this rank's prepared record of the step about to
        be applied, sent to its record peers, then a barrier; once per step."""
        if self.last is None or self._prepared == self.last or self.comm.world_size == 1:
            return
        faults.point("step-gradients")
        self._prepared = after = self.last
        record = Record.make(
            after + 1,
            self.comm.rank,
            state,
            fingerprinted=False,
            after=after,
            layouts=self.tracker.layouts(state),
        )
        inflight.keep_own(self.job, record)
        what = f"preparing step {after + 1}"
        # Kept before the barrier: a rank it fails on may be the only one holding them.
        for owner, received in self._send(record, what).items():
            inflight.keep_held(self.job, owner, received.after or 0, received.data)
        if dist.is_initialized() and dist.get_backend() == "gloo":
            with _failing(what):  # in order with the step's own collectives
                dist.barrier()
        faults.point("step-prepared")

    def exchange(self, record: Record) -> None:
        """Send ``record`` to the partners and keep the records the sources send, on the
        caller's thread: when `Checkpointer.step` returns, the peer holds this step's
        record, so a rank that dies later can be healed at this step. Point-to-point
        with one or two partners (one round trip, tag `records.TAG`, concurrent with
        the worker's replica traffic), never a collective. A failed peer fails it like
        a collective: `CheckpointError`."""
        faults.point("step-applied")
        got = self._send(record, f"sending the record of step {record.step}")
        for owner, received in got.items():
            records.keep_held(self.job, owner, received.step, received.data)

    def _send(self, record: Record, what: str) -> dict[int, Record]:
        """Send ``record`` to the partners and receive the sources' records, checked. A
        failed peer: `PeerLostError`."""
        with _failing(what):
            got = records.exchange(
                self.comm, dict.fromkeys(self.partners, record.data), self.sources
            )
        return {owner: Record.decode(data, f"rank {owner}") for owner, data in got.items()}

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

    def restored(
        self,
        step: int | None,
        state: Mapping[str, Any],
        memory: MemoryTier | None,
        directory: Directory | None = None,
    ) -> None:
        """After a restore of ``step``, collective. The DDP layouts: every rank proposes
        the layouts it knows (its record, a record it holds, its shared memory; rank 0
        also the info file of ``step`` in ``directory``, which a restart that lost every
        node's memory restores from); all take
        the first proposal in rank order that fits the state, so the wrappers of every
        rank get the same layout or none (a malformed one, from a file or a peer, is
        passed over with a warning: it never breaks a restore). And if any rank records
        steps (a survivor; a replacement has no records yet), every rank prepares each
        step from the next one on (`prepare`): all of them, or none would get past it."""
        known = self._known(state, memory, step, directory)
        proposals = self.comm.all_gather([known, self.last is not None])
        for rank, proposal in enumerate(proposals):
            raw = proposal[0] if isinstance(proposal, list) and len(proposal) == 2 else None
            chosen = _fitting(raw, state, f"the DDP layouts rank {rank} proposed")
            if chosen:
                self.tracker.owe(state, chosen)
                break
        recording = any(isinstance(p, list) and len(p) == 2 and p[1] is True for p in proposals)
        if step is not None and recording:
            self.last = step
            self.hook(state)

    def _known(
        self,
        state: Mapping[str, Any],
        memory: MemoryTier | None,
        step: int | None = None,
        directory: Directory | None = None,
    ) -> Layouts | None:
        for raw, where in self._candidates(memory, step, directory):
            layouts = _fitting(raw, state, where)
            if layouts:
                return layouts
        return None

    def _candidates(
        self, memory: MemoryTier | None, step: int | None, directory: Directory | None
    ) -> Iterator[tuple[Any, str]]:
        """The layouts this rank knows of, unchecked, each with where it came from: the
        step's info file in storage last, and on rank 0 alone (one read, none at all
        where an earlier source fits)."""
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
        if directory is not None and step is not None and self.comm.rank == 0:
            path = f"{step_dir(step)}/{INFO}"
            yield _saved(directory, path), f"the DDP layouts in {directory}/{path}"

    def forget(self) -> None:
        """Drop every record of the job (it finished)."""
        records.forget(self.job)
        inflight.forget(self.job)

    def stop(self) -> None:
        self.tracker.stop()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()


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


def _saved(directory: Directory, path: str) -> Any:
    """The DDP layouts a save noted in its info file ``path`` (unchecked), None if there
    are none or the file cannot be read (a step saved without them, a snapshot's step)."""
    try:
        return messages.json_object(directory.storage.read(path)).get("ddp_layouts")
    except FileNotFoundError:
        return None
    except Exception as e:  # a layout is an optimisation: never a reason to fail a restore
        log.warning("ignoring %s/%s: %s (no DDP bucket layout read from it)", directory, path, e)
        return None


@contextlib.contextmanager
def _failing(what: str) -> Iterator[None]:
    """gloo's errors as the checkpointer's: `PeerLostError` where a peer is gone (or the
    group was aborted), else `CheckpointError`."""
    try:
        yield
    except RuntimeError as e:
        lost = PeerLostError if lost_peer(e) else CheckpointError
        raise lost(f"{what} failed ({brief(e)}): a peer failed") from e
