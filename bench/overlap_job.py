"""bench/overlap.py's job, an MLP trained with AdamW, and the methods it saves with: one
library's background save each, run the way its documentation says."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import unbroken
from common import MIB

# periods of EVERY steps with a save at the start of each, between as many with none
PERIODS, EVERY = 3, 10
# a step whose forward and backward outweigh the optimizer step, as in training that
# is worth saving: 128 rows through four square layers of the state's width
BATCH = 128
METHODS = (
    *("unbroken", "unbroken_copy", "dcp_thread", "dcp_process", "torch_checkpointing"),
    *("snapshot", "snapshot_copy", "control"),
)
# node-local shared memory, where snapshots live: a folder on a disk would have the
# kernel write every snapshot back to that disk, on the cores training uses
SHM = Path("/dev/shm")
LABELS = {
    "unbroken": "unbroken, overlapped",
    "unbroken_copy": "unbroken, overlap=False",
    "dcp_thread": "DCP async_save + DefaultStager, thread",
    "dcp_process": "DCP async_save + DefaultStager, process",
    "torch_checkpointing": "torch-checkpointing, buffered IO, no fsync",
    "snapshot": "unbroken snapshot every step, overlapped",
    "snapshot_copy": "unbroken snapshot every step, overlap=False",
    "control": "no save: the control (periods timed alike, nothing saved)",
}


def make_model(mib: int, seed: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """Parameters of ``mib`` / 3 MiB (AdamW keeps two more of the same): about ``mib``."""
    width = int(((mib * MIB / 3 / 4) / 4) ** 0.5)  # four square layers
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, guard: Any) -> None:
    width = next(model.parameters()).shape[1]
    optim.zero_grad()
    model(torch.randn(BATCH, width)).pow(2).mean().backward()
    guard(lambda: optim.step())


def values(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [v.clone() for v in model.state_dict().values()]
    return out + [v.clone() for s in optim.state.values() for v in s.values()]


class Method:
    """One library's background save of ``{"model", "optim"}`` into ``root``."""

    def __init__(self, name: str, root: Path, model: nn.Module, optim: Any) -> None:
        self.name, self.root, self.model, self.optim = name, root, model, optim
        self.pending: Any = None  # waits for the last save
        self.done: Callable[[], bool]  # whether the last save is durable (not snapshots)
        if name.startswith("unbroken"):
            self.ckpt = unbroken.Checkpointer(root, overlap=name == "unbroken", keep=None)
        if name.startswith("snapshot"):
            self.ckpt = self.memory(overlap=name == "snapshot")
        if name.startswith("dcp"):
            self.stager = DefaultStager(StagingOptions(False, False, True, False))
            self.staging: Any = None
        if name == "torch_checkpointing":
            from torch_checkpointing import CheckpointManager
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

            # Its default O_DIRECT writes fail here (EINVAL closing a file's unaligned
            # tail, ext4): buffered writes, otherwise as its README runs it. It never
            # calls fsync (0.1.1): its save ends in the page cache, not on the disk.
            storage = LocalFileSystemStorageConfig(use_direct_io=False)
            self.manager = CheckpointManager.Config(storage_config=storage).build()

    def memory(self, overlap: bool = True) -> unbroken.Checkpointer:
        shm = str(shm_dir(self.root))
        return unbroken.Checkpointer(self.root, memory=True, memory_dir=shm, overlap=overlap)

    def state(self) -> dict[str, Any]:
        if self.name.startswith(("unbroken", "snapshot")):
            return {"model": self.model, "optim": self.optim}
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def save(self, step: int) -> None:
        if self.name.startswith("unbroken"):
            saving = self.ckpt.save(step, self.state(), blocking=False)
            self.pending, self.done = saving.wait, saving.done
        elif self.name.startswith("snapshot"):
            self.ckpt.snapshot(step, self.state())
            self.pending = self.ckpt.wait
        elif self.name == "control":
            self.pending, self.done = (lambda: None), (lambda: True)
        elif self.name.startswith("dcp"):
            process = "process" in self.name
            got = dcp.async_save(
                self.state(), checkpoint_id=str(self.root / str(step)), async_stager=self.stager,
                async_checkpointer_type=(
                    AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
                ),
            )  # fmt: skip
            assert isinstance(got, AsyncSaveResponse)  # what an async stager makes it return
            self.staging = got.staging_completion
            self.pending, self.done = got.upload_completion.result, got.upload_completion.done
        else:
            written = self.manager.save(str(self.root / str(step)), self.state())
            assert written is not None  # an async saver's write future
            self.pending, self.done = written.result, written.done

    def prepare(self) -> None:
        """Staging memory allocated ahead, where the library can (a script does it once)."""
        if self.name.startswith("unbroken"):
            self.ckpt.prepare(self.state())
        elif self.name.startswith("snapshot"):
            for step in range(3):  # every slot mapped and touched, as after a few steps
                self.save(step)
        elif self.name == "torch_checkpointing":
            self.manager.prewarm_staging(self.state())
        time.sleep(1.0)  # done, and the machine quiet again, before anything is timed

    def guard(self, step: Callable[[], None]) -> None:
        """The optimizer step, as each library says to run it while a save stages."""
        if self.name.startswith("dcp") and self.staging is not None:
            self.staging.result()
            self.staging = None
        if self.name == "torch_checkpointing":
            with self.manager.lock():
                step()
            return
        step()

    def load(self, step: int, model: nn.Module, optim: Any) -> None:
        if self.name.startswith("unbroken"):
            with unbroken.Checkpointer(self.root) as ckpt:
                ckpt.restore({"model": model, "optim": optim}, step)
            return
        if self.name.startswith("snapshot"):  # the newest, from memory
            with self.memory() as ckpt:
                assert ckpt.restore({"model": model, "optim": optim}) == step
            return
        into = {"model": model.state_dict(), "optim": optim.state_dict()}
        if self.name.startswith("dcp"):
            dcp.load(into, checkpoint_id=str(self.root / str(step)))
        else:
            self.manager.load(str(self.root / str(step)), into=into)
        model.load_state_dict(into["model"])
        optim.load_state_dict(into["optim"])

    def close(self) -> None:
        if self.name.startswith(("unbroken", "snapshot")):
            self.ckpt.close()
        elif self.name.startswith("dcp"):
            self.stager.close()
        elif self.name == "torch_checkpointing":
            self.manager.close()


def shm_dir(root: Path) -> Path:
    """The shared-memory folder of the method saving into ``root``: the same on every
    rank (the ranks are one node's), removed with `remove`."""
    return SHM / f"{root.parent.name}-{root.name}" if SHM.is_dir() else root / "shm"


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(shm_dir(root), ignore_errors=True)
