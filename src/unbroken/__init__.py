"""unbroken: keep distributed PyTorch training running through failures.

>>> import unbroken
>>> ckpt = unbroken.Checkpointer("runs/exp1")
>>> ckpt.save(step, {"model": model, "optim": optim, "rng": unbroken.RNGState()})
>>> step = ckpt.restore(state)

The names below are imported on first use (PEP 562), not with the package: importing
torch takes seconds, and the ``unbroken`` command (``--help``, ``ls``...) imports this
package without needing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.checkpointer import Checkpointer
    from unbroken.errors import CheckpointError, CorruptCheckpointError
    from unbroken.job.background import PendingSave
    from unbroken.restoring.reshard import PerRank
    from unbroken.restoring.sources import Origin, Restored
    from unbroken.state import Progress, RNGState, Stateful

# Each public name, and the module that defines it.
_WHERE = {
    "CheckpointError": "unbroken.errors",
    "Checkpointer": "unbroken.checkpointer",
    "CorruptCheckpointError": "unbroken.errors",
    "Origin": "unbroken.restoring.sources",
    "PendingSave": "unbroken.job.background",
    "PerRank": "unbroken.restoring.reshard",
    "Progress": "unbroken.state",
    "RNGState": "unbroken.state",
    "Restored": "unbroken.restoring.sources",
    "Stateful": "unbroken.state",
}
__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "Origin",
    "PendingSave",
    "PerRank",
    "Progress",
    "RNGState",
    "Restored",
    "Stateful",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
