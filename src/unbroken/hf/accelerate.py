"""Accelerate's ``save_state``/``load_state``, through unbroken's checkpoints.

>>> model, optim, data, sched = accelerator.prepare(model, optim, data, sched)
>>> ckpt = unbroken.Checkpointer("s3://bucket/run", keep=3)  # every rank, after Accelerator()
>>> step = unbroken.hf.accelerate.load_state(accelerator, ckpt) or 0
>>> unbroken.hf.accelerate.save_state(accelerator, ckpt, step, blocking=False)

What ``accelerator.save_state`` covers, kept as unbroken keeps any state: sharded,
checksummed, committed atomically, on local disk or object storage (``save_state``
writes ``torch.save`` files into a local folder). Every model, optimizer and scheduler
the accelerator prepared, its gradient scaler, the objects given to
``register_for_checkpointing``, each rank's RNG streams, the accelerator's step counter
(gradient accumulation), and the position of data loaders that have one
(``DataLoaderConfiguration(use_stateful_dataloader=True)``; others restart their epoch,
as with ``save_state``: skip the batches trained with ``accelerator.skip_first_batches``).
Resumed mid-epoch, the run computes what an uninterrupted one computes, bit for bit.
Like ``save_state``, both calls run on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from unbroken.state import RNGState

if TYPE_CHECKING:
    from unbroken import Checkpointer, PendingSave


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``, which wraps it
    without the step hooks unbroken registers on an optimizer."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class LaterRNG:
    """Each rank's RNG streams, saved now, restored when `apply` is called: a data loader
    draws its epoch's seed from them as it starts iterating, which an uninterrupted run
    did before the save, so the streams are set after that, before the first forward."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return RNGState().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict

    def apply(self) -> None:
        if self.loaded is not None:
            RNGState().load_state_dict(self.loaded)
            self.loaded = None

    def at_next_forward(self, model: torch.nn.Module) -> None:
        """`apply` just before ``model``'s next forward, once."""

        def apply(*_: Any) -> None:
            handle.remove()
            self.apply()

        handle = model.register_forward_pre_hook(apply)


class _StepCounter:
    """The accelerator's own step counter, which decides when gradients accumulate."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.accelerator.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.accelerator.step = state_dict["step"]


def training_state(accelerator: Any) -> dict[str, Any]:
    """What ``save_state`` would save, by name: ``model``, ``optim``, ``sched`` (then
    ``model_1``... for a second one), ``data``, ``custom_0``..., ``scaler``, ``rng``."""
    state: dict[str, Any] = {}
    groups = [
        ("model", [accelerator.unwrap_model(m) for m in accelerator._models]),
        ("optim", [unwrapped(o) for o in accelerator._optimizers]),
        ("sched", accelerator._schedulers),
        ("data", [d for d in accelerator._dataloaders if hasattr(d, "state_dict")]),
    ]
    for prefix, values in groups:
        for i, value in enumerate(values):
            state[prefix if i == 0 else f"{prefix}_{i}"] = value
    for i, value in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = value
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["rng"] = LaterRNG()
    state["accelerator"] = _StepCounter(accelerator)
    return state


def save_state(
    accelerator: Any, checkpointer: Checkpointer, step: int, *, blocking: bool = True
) -> PendingSave:
    """``accelerator.save_state()`` as ``step`` of ``checkpointer``; ``blocking=False``
    returns once the state is captured and writes it in the background."""
    return checkpointer.save(step, training_state(accelerator), blocking=blocking)


def load_state(accelerator: Any, checkpointer: Checkpointer, step: int | None = None) -> int | None:
    """``accelerator.load_state()`` from ``checkpointer``: ``step``, or the newest (None,
    changing nothing, where there is none). Call it after ``prepare``. Each rank's RNG
    streams are set just before the first model's next forward (see `LaterRNG`), so a
    resumed run draws what an uninterrupted one draws."""
    state = training_state(accelerator)
    step = checkpointer.restore(state, step)
    if step is not None and accelerator._models:
        state["rng"].at_next_forward(accelerator._models[0])
    else:
        state["rng"].apply()
    return step
