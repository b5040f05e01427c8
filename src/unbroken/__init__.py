"""unbroken: keep distributed PyTorch training running through failures.

>>> import unbroken
>>> ckpt = unbroken.Checkpointer("runs/exp1")
>>> ckpt.save(step, {"model": model, "optim": optim, "rng": unbroken.RNGState()})
>>> step = ckpt.restore(state)
"""

from unbroken.checkpointer import Checkpointer
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.job.background import PendingSave
from unbroken.restoring.reshard import PerRank
from unbroken.restoring.sources import Origin, Restored
from unbroken.state import Progress, RNGState, Stateful

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
