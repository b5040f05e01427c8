"""State capture: application state <-> a flat dict of tensors plus a JSON tree.

The JSON tree keeps the structure of every ``state_dict`` with each tensor replaced by a
``{"__tensor__": key}`` placeholder. Tuples and dicts whose keys are not plain strings
(optimizer state is keyed by int) get tagged encodings so they come back exactly as they
were. Nothing here pickles: a value that is neither a tensor nor JSON is an error.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from unbroken.errors import CheckpointError
from unbroken.tree import ITEMS, TENSOR, TUPLE, Json


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers,
    LR schedulers, data loaders, and unbroken's own `RNGState` and `Progress`."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Progress:
    """The training loop's own counters and data position, as a `Stateful`.

    >>> progress = Progress(step=0, epoch=0, batch=0)
    >>> progress.step += 1

    Values must be JSON (numbers, strings, lists, dicts). Each rank saves its own.
    """

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # only reached for missing attributes
        raise AttributeError(f"Progress has no counter {name!r}; set it first")

    def __setattr__(self, name: str, value: Any) -> None:  # lets type checkers allow any name
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"Progress({fields})"

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update(state_dict)


class RNGState:
    """Every random stream a training step may draw from: Python ``random``, NumPy's
    global generator, torch's CPU generator and, when present, every CUDA device's.

    Restoring it makes the next draws identical to those of an uninterrupted run. Each
    rank saves its own streams (they usually differ between ranks)."""

    def state_dict(self) -> dict[str, Any]:
        version, mt, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": [version, list(mt), gauss],
            "numpy": [kind, np.asarray(keys).tolist(), pos, has_gauss, cached],
            "torch": _b64(torch.get_rng_state()),
        }
        if torch.cuda.is_available():
            state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        version, mt, gauss = state_dict["python"]
        random.setstate((version, tuple(mt), gauss))
        kind, keys, pos, has_gauss, cached = state_dict["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_unb64(state_dict["torch"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            saved = state_dict["cuda"]
            if len(saved) != torch.cuda.device_count():
                raise CheckpointError(
                    f"the checkpoint holds RNG state for {len(saved)} CUDA devices but this "
                    f"process sees {torch.cuda.device_count()}; set CUDA_VISIBLE_DEVICES to match"
                )
            torch.cuda.set_rng_state_all([_unb64(s) for s in saved])


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


class Captured(NamedTuple):
    """The state walked once (`capture`): ``tensors`` maps a slash-separated key
    (``"optim/state/0/exp_avg"``) to the live tensor (no copy is made), ``tree`` each
    top-level entry to its JSON encoding. A restore captures the state once and hands
    this to every stage (healing, checking, resharding, applying), so each Stateful's
    ``state_dict()`` runs once and every stage sees the same tensors."""

    tensors: dict[str, torch.Tensor]
    tree: dict[str, Json]

    def only(self, names: Collection[str]) -> Captured:
        """The entries ``names`` alone: their trees and tensors."""
        keep = set(names)
        tensors = {k: t for k, t in self.tensors.items() if k.split("/", 1)[0] in keep}
        return Captured(tensors, {n: v for n, v in self.tree.items() if n in keep})

    def refreshed(self, state: Mapping[str, Any], names: Collection[str]) -> Captured:
        """With the entries ``names`` walked again: a stage gave them new tensors (an
        optimizer's first state, see `init_state`)."""
        if not names:
            return self
        again = capture({name: state[name] for name in names})
        rest = self.only(set(self.tree) - set(names))
        return Captured({**rest.tensors, **again.tensors}, {**rest.tree, **again.tree})


def capture(state: Mapping[str, Any]) -> Captured:
    """Flatten ``state`` into `Captured` ``(tensors, tree)``."""
    tensors: dict[str, torch.Tensor] = {}
    tree: dict[str, Json] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise CheckpointError(f"state key {name!r} must be a non-empty string without '/'")
        if is_stateful(value):
            value = value.state_dict()
        tree[name] = _encode(value, name, tensors)
    return Captured(tensors, tree)


def param_indices(optim: Optimizer) -> dict[int, tuple[int, torch.Tensor]]:
    """``{id(parameter): (index, parameter)}``, each parameter numbered as
    ``Optimizer.state_dict`` numbers it (its first place in the param groups), so that
    ``"<entry>/state/<index>"`` is its state's captured key."""
    params = [p for group in optim.param_groups for p in group["params"]]
    index: dict[int, tuple[int, torch.Tensor]] = {}
    for i, param in enumerate(params):
        index.setdefault(id(param), (i, param))
    return index


def init_state(optim: Optimizer) -> bool:
    """Give a fresh optimizer of sharded (DTensor) parameters its state with one
    zero-learning-rate step on zero grads, so that a restore reads into it in place,
    sharded like its parameters (FSDP2 needs DTensor state). Returns False, doing
    nothing, if it already has state, any grad is set, or no parameter is a DTensor:
    plain tensors of state are read into new tensors, which costs nothing like a step
    over the whole model."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if (
        optim.state
        or any(p.grad is not None for p in params)
        or not any(isinstance(p, DTensor) for p in params)
    ):
        return False
    lrs = [group["lr"] for group in optim.param_groups]
    for group in optim.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs, strict=True):
            group["lr"] = lr
        optim.zero_grad(set_to_none=True)
    return True


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Json:
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise CheckpointError(f"two tensors map to the key {path!r}; rename one of them")
        # Checkpoints hold a tensor's bytes in row-major order, which sparse, MKL-DNN and
        # nested tensors do not have: refused here, by name, not by torch deep in a save.
        if value.is_nested:
            raise CheckpointError(
                f"{path} is a nested tensor; checkpoints hold dense tensors only: return "
                "its components (.unbind()) or a padded copy (.to_padded_tensor(0)) from "
                "state_dict(), and rebuild it in load_state_dict()"
            )
        if value.layout != torch.strided:
            raise CheckpointError(
                f"{path} is a tensor of layout {value.layout} (sparse or MKL-DNN); "
                "checkpoints hold dense tensors only: return .to_dense() from state_dict() "
                "(and convert it back in load_state_dict())"
            )
        if value.device.type == "meta":  # numpy's TypeError deep in a save, otherwise
            raise CheckpointError(
                f"{path} is a tensor on the meta device, which holds no data: materialise "
                "the module first (module.to_empty(device=...), then load or initialise its "
                "weights), or leave the tensor out of state_dict()"
            )
        tensors[path] = value
        return {TENSOR: path}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        for k in value:
            if not isinstance(k, str | int | bool) and k is not None:
                raise CheckpointError(f"{path} has a key of type {type(k).__name__}: {k!r}")
        return {ITEMS: [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in value.items()]}
    raise CheckpointError(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints hold "
        "tensors and JSON values only (loading never unpickles). Convert it in state_dict()."
    )
