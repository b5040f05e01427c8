"""What `Checkpointer.step` does at a step boundary besides healing: ask the save policy
and watch for preemption, with every rank agreeing.

Decisions must agree across ranks (saves are collective). A policy that counts steps
only decides the same everywhere and costs no communication. One that reads the clock
(`Every(seconds=...)`, `Auto`), and a preemption signal that reaches the ranks at
different moments, are agreed by one all-reduce of two integers per step on a gloo group
of their own (not the checkpointer's, which its background thread uses): rank 0's
policy decides, and a signal on any rank counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from unbroken.format.directory import Directory
from unbroken.job.comm import Comm
from unbroken.policies import Action, SavePolicy
from unbroken.preemption import Preempted, Preemption, Watch
from unbroken.run import worker

log = logging.getLogger("unbroken")

_ACTIONS: tuple[Action, ...] = ("none", "snapshot", "save")


class _Loop(Protocol):
    """What `Cadence.at_step` uses of the Checkpointer."""

    _directory: Directory

    def save(self, step: int, state: Mapping[str, Any], *, blocking: bool = ...) -> Any: ...

    def snapshot(self, step: int, state: Mapping[str, Any]) -> None: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...

    def _saving(self, step: int) -> bool: ...


class Cadence:
    """The policy and the preemption watch of one Checkpointer (either may be None)."""

    def __init__(
        self,
        policy: SavePolicy | None,
        preemption: Preemption | None,
        group: dist.ProcessGroup | None,
        timeout: timedelta,
        world_size: int,
    ) -> None:
        self.policy = policy
        self.watch = Watch(preemption) if preemption is not None else None
        clock = policy is not None and policy.uses_clock
        self._comm: Comm | None = None
        if world_size > 1 and (clock or self.watch is not None):
            self._comm = Comm(group, timeout)  # collective: every rank has the same config

    def at_step(self, step: int, state: Mapping[str, Any], ckpt: _Loop) -> None:
        """Take what the policy says at ``step``; after a preemption signal, save this
        step (blocking; it is newer than any snapshot), close and raise `Preempted`."""
        action, preempted = self.decide(step)
        started = time.perf_counter()
        if (action == "save" or preempted) and not ckpt._saving(step):
            ckpt.save(step, state, blocking=preempted or self.blocking)
        elif action == "snapshot":
            ckpt.snapshot(step, state)
        self.done(action, step, time.perf_counter() - started)
        if preempted:  # every rank agreed
            ckpt.wait()
            saved = step if ckpt._directory.is_committed(step) else None
            ckpt.close()
            raise self.preempted(step, saved, time.perf_counter() - started)

    def decide(self, step: int) -> tuple[Action, bool]:
        """This step's action, and whether the job is preempted. Collective when agreed."""
        action = "none" if self.policy is None else self.policy.decide(step, time.monotonic())
        preempted = self.watch is not None and self.watch.requested
        if self._comm is None or self._comm.group is None:
            return action, preempted
        mine = _ACTIONS.index(action) if self._comm.rank == 0 else 0
        flags = torch.tensor([mine, int(preempted)], dtype=torch.int64)
        self._comm.all_reduce_max(flags)
        return _ACTIONS[int(flags[0])], bool(flags[1])

    @property
    def blocking(self) -> bool:
        """Whether the policy's saves block (default: they persist in the background)."""
        return bool(getattr(self.policy, "blocking", False))

    def preempted(self, step: int, saved: int | None, took_s: float) -> Preempted:
        """Log and record the preemption save; the exception that ends the process."""
        assert self.watch is not None
        message = self.watch.report(step, saved, took_s)
        log.warning("%s", message)
        worker.event("preempted", step=step, saved=saved, took_s=round(took_s, 3))
        return Preempted(self.watch.config.exit_code)

    def done(self, action: Action, step: int, cost_s: float) -> None:
        if self.policy is not None:
            self.policy.done(action, step, time.monotonic(), cost_s)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self._comm is not None:
            self._comm.close()
