"""torchtitan's own trainer, checkpointed by unbroken: a checkpoint manager that a job's
config names in place of torchtitan's DCP one; no torchtitan file changes.

    from unbroken.torchtitan import CheckpointManager

    def my_job() -> Trainer.Config:  # a config_registry function
        config = llama3_debugmodel()
        config.checkpoint = CheckpointManager.Config(enable=True, interval=10, keep_latest_k=3)
        return config

torchtitan's `Trainer.Config.checkpoint` is typed ``BaseCheckpointManager.Config`` and
built with ``config.checkpoint.build(...)``: the nested ``Config`` names its owner, so
the trainer builds this manager and calls it where it calls its own (``load`` before
the first step, ``save(step)`` after each optimizer step, ``close``). The options are
torchtitan's (``--checkpoint.interval``, ``--checkpoint.keep_latest_k``, ``load_step``,
``exclude_from_loading``, ``load_only``...) plus unbroken's below.

Each ``save(step)`` call, in this order:

- ``Checkpointer.step``: a per-step record of what replicas do not share, so that under
  ``unbroken run --in-process`` a lost rank is healed from live replicas;
- every ``snapshot_interval`` steps, ``Checkpointer.snapshot``: into shared memory and a
  peer's memory;
- every ``interval`` steps and at the last step, ``Checkpointer.save``, in the background
  (``async_save``): sharded, checksummed, committed atomically, the newest
  ``keep_latest_k`` kept. A checkpoint saved on N ranks restores on M.

What is saved: the model parts (``model``), torchtitan's optimizers one by one
(``optimizer``: torch optimizers, so that their state is sharded like the parameters),
``lr_scheduler``, ``train_state`` (step, tokens seen), ``dataloader`` (per rank, without
torchtitan's pickle) and ``rng`` (per rank). Under ``--in-process`` torchtitan builds its
trainer anew in each generation; a rank that survived hands its model and optimizer
tensors to the new trainer (`carry`), in memory, before restoring.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.tools import filesystem

from unbroken import Checkpointer, PendingSave
from unbroken.restoring.reshard import PerRank
from unbroken.run import contract
from unbroken.state import RNGState, init_state

__all__ = ["CheckpointManager"]

log = logging.getLogger("unbroken")

# torchtitan's names for the entries of its checkpoints (torchtitan.components.checkpointer)
MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE = (
    "model", "optimizer", "lr_scheduler", "dataloader", "train_state",
)  # fmt: skip

# The state of the generation before this one in this process (`carry`).
_previous: dict[str, Any] = {}


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's ``BaseCheckpointManager`` on unbroken's `Checkpointer`."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        enable: bool = True
        """Whether to checkpoint at all (torchtitan's default is off)."""

        memory: bool = True
        """Snapshots in shared memory (``snapshot_interval``), restored first; each rank
        keeps its own shards."""

        replicas: int = 1
        """Peers holding a copy of each rank's snapshot, on other nodes."""

        snapshot_interval: int = 1
        """Steps between snapshots into memory; 0 for none."""

        heal: bool = True
        """A per-step record for healing from live replicas (``--in-process``)."""

        async_save: bool = True
        """Write and commit saves in the background (``save(..., blocking=False)``)."""

        timeout: float = 600.0
        """Seconds any collective of the checkpointer may take."""

        overlap: bool = True
        """Copy parameters and optimizer state beside the next step (`Checkpointer`'s
        ``overlap``)."""

        data_on_reshard: Literal["refuse", "keep"] = "refuse"
        """On another number of ranks: refuse, or keep each rank's fresh data position."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.snapshot_interval < 0:
                raise ValueError("snapshot_interval: steps between snapshots, 0 for none")
            if self.snapshot_interval and not self.memory:
                raise ValueError("snapshot_interval needs memory=True (snapshots are memory)")
            if self.replicas and not self.memory:
                raise ValueError("replicas copy memory snapshots: they need memory=True")
            for name in ("initial_load_in_hf", "last_save_in_hf", "create_seed_checkpoint"):
                if getattr(self, name):
                    raise ValueError(
                        f"{name}: unbroken writes its own format; export a step to Hugging "
                        "Face with `unbroken export`, or use torchtitan's CheckpointManager"
                    )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.save_future: Future[Any] | None = None
        self.folder = filesystem.join(base_folder, config.folder)
        self.state = build_state(model_parts, optimizers, lr_schedulers, dataloader, states)
        self.state[DATALOADER] = PerRank(self.state[DATALOADER], config.data_on_reshard)
        if os.environ.get(contract.IN_PROCESS_ENV) == "1":  # `unbroken run --in-process`
            carry(_previous, self.state)
            _previous.clear()
            _previous.update(self.state)
        self.memory = config.memory
        self.ckpt = Checkpointer(
            self.folder, keep=config.keep_latest_k or None, memory=self.memory,
            replicas=config.replicas if self.memory else 0, timeout=config.timeout,
            overlap=config.overlap,
        )  # fmt: skip
        self._pending: PendingSave | None = None
        if config.last_save_model_only:
            log.info("checkpoint.last_save_model_only is ignored: the last save is whole")

    def _load(self, step: int = -1) -> bool:
        config = self.config
        state = {k: v for k, v in self.state.items() if k not in config.exclude_from_loading}
        if set(state) != set(self.state):
            restored = self.ckpt.restore(state, None if step < 0 else step, strict=False)
        else:
            restored = self.ckpt.restore(state, None if step < 0 else step)
        if restored is None and config.initial_load_path:
            restored = self._initial_load(config.initial_load_path)
        if restored is None:
            return False
        origin = self.ckpt.last_restore
        kind = origin.origin.kind if origin is not None else "storage"
        log.info("restored step %d (%s) from %s", restored, kind, self.folder)
        return True

    def _initial_load(self, path: str) -> int | None:
        """Another job's newest checkpoint (unbroken's format), the model alone by default."""
        state = self.state
        if self.config.initial_load_model_only:
            state = {k: v for k, v in state.items() if k == MODEL or k.startswith(MODEL + "_")}
        with Checkpointer(path, timeout=self.config.timeout) as other:
            return other.restore(state, strict=False)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        config, ckpt = self.config, self.ckpt
        if config.heal:
            ckpt.step(curr_step, self.state)
        every = config.snapshot_interval if self.memory else 0
        if every and curr_step % every == 0:
            ckpt.snapshot(curr_step, self.state)
        if config.load_only or not self._due(curr_step, last_step):
            return False
        blocking = last_step or not config.async_save
        self._pending = ckpt.save(curr_step, self.state, blocking=blocking)
        # torchtitan reads save_future only as "a save is in flight" (`_wait_for_saving`)
        self.save_future = None if blocking else Future()
        return True

    def _due(self, step: int, last_step: bool) -> bool:
        first = step == 1 and self.config.enable_first_step_checkpoint
        return first or last_step or step % self.config.interval == 0

    def _wait_for_saving(self) -> None:
        pending, self._pending, self.save_future = self._pending, None, None
        if pending is not None:
            pending.wait()

    def _maybe_wait_for_staging(self) -> None:
        """Nothing: ``save(..., blocking=False)`` returns once the state is captured
        (with ``overlap``, what only the optimizer changes is copied before its next
        step begins, by `Checkpointer`'s step pre-hook), so the step may go on."""

    def _close(self) -> None:
        """Waits for the saves in flight. A manager closed leaves nothing to `carry`:
        only a generation abandoned after a failure hands its state on."""
        self.save_future = self._pending = None
        _previous.clear()
        self.ckpt.close()


def build_state(
    model_parts: list[nn.Module],
    optimizers: Any,
    lr_schedulers: Any,
    dataloader: Any,
    states: Mapping[str, Any],
) -> dict[str, Any]:
    """What a checkpoint holds, under torchtitan's names (``model``, ``optimizer``...,
    ``model_1``, ``optimizer_1``... for further parts and optimizers)."""
    state: dict[str, Any] = {}
    for i, part in enumerate(model_parts):
        state[MODEL if i == 0 else f"{MODEL}_{i}"] = part
    inner = list(getattr(optimizers, "optimizers", [optimizers]))
    for i, optim in enumerate(inner):
        state[OPTIMIZER if i == 0 else f"{OPTIMIZER}_{i}"] = optim
    state[LR_SCHEDULER] = lr_schedulers
    state[DATALOADER] = DataPosition(dataloader)
    state["rng"] = PerRank(RNGState(), on_reshard="keep")
    state.update(states)  # torchtitan's: train_state (the trainer's step and tokens seen)
    return state


class DataPosition:
    """A torchtitan dataloader's position as unbroken keeps it: the loader's own state
    dict (``StatefulDataLoader.state_dict``), not torchtitan's pickled copy of it, so
    that nothing is unpickled on restore; ``{}`` for no loader."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.loader, StatefulDataLoader):
            return StatefulDataLoader.state_dict(self.loader)
        return {} if self.loader is None else dict(self.loader.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loader is None or not state_dict:
            return
        if isinstance(self.loader, StatefulDataLoader):
            StatefulDataLoader.load_state_dict(self.loader, state_dict)
        else:
            self.loader.load_state_dict(state_dict)


def carry(previous: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Copy the model and optimizer tensors of this process's previous generation into
    this one's, in memory: torchtitan builds its trainer anew after a failure, and a
    rank that survived keeps what it held. Healing (`Checkpointer.restore`) then finds
    this rank live at its last step; the rest (schedulers, data, counters) comes from
    the rank's own step record. Nothing is carried where the shapes differ."""
    for name, new in state.items():
        old = previous.get(name)
        if isinstance(new, nn.Module) and isinstance(old, nn.Module):
            _carry_module(old, new)
        elif isinstance(new, Optimizer) and isinstance(old, Optimizer):
            _carry_optimizer(old, new)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


@torch.no_grad()
def _carry_module(old: nn.Module, new: nn.Module) -> None:
    """Parameter to parameter, not through ``state_dict``: torchtitan's state dict hooks
    give some entries as new tensors (its fused QKV, split), and a copy into those
    would be lost."""
    before = dict(old.named_parameters()) | dict(old.named_buffers())
    after = dict(new.named_parameters()) | dict(new.named_buffers())
    if before.keys() != after.keys() or any(
        _local(before[k]).shape != _local(t).shape for k, t in after.items()
    ):
        log.warning("the model changed shape across generations: not carried")
        return
    for key, t in after.items():
        _local(t).copy_(_local(before[key]))


@torch.no_grad()
def _carry_optimizer(old: Optimizer, new: Optimizer) -> None:
    olds = [p for g in old.param_groups for p in g["params"]]
    news = [p for g in new.param_groups for p in g["params"]]
    if not old.state or len(olds) != len(news):
        return
    init_state(new)  # DTensor state on the new mesh, to copy into
    for p_old, p_new in zip(olds, news, strict=True):
        state_old, state_new = old.state.get(p_old, {}), new.state.get(p_new, {})
        for key, value in state_old.items():
            target = state_new.get(key)
            if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor):
                _local(target).copy_(_local(value))
            elif isinstance(value, torch.Tensor):  # plain tensors: `init_state` made none
                state_new[key] = value.detach().clone()
            else:
                state_new[key] = value
        new.state[p_new] = state_new
    for g_old, g_new in zip(old.param_groups, new.param_groups, strict=True):
        g_new.update({k: v for k, v in g_old.items() if k != "params"})
