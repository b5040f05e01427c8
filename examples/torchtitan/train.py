"""torchtitan's own trainer and train loop, checkpointed by unbroken (the config's
``checkpoint`` is `unbroken.torchtitan.CheckpointManager`, see titan_configs.py), under
in-process recovery: a killed rank is replaced, the survivor keeps its process and
state, and the replacement is healed from it, a live replica (HSDP: 2 replicas of 1
shard). Runs on CPU with gloo:

    unbroken run --in-process --simulate-nodes 2 --nproc-per-node 1 --max-restarts 1 \\
        --inject-fault "kill rank=1 step=5" examples/torchtitan/train.py \\
        --module titan_configs --config llama3_debug_unbroken --dump_folder runs/titan \\
        --parallelism.data_parallel_replicate_degree 2

and then on one rank, from the checkpoint the two saved (resharded on restore):

    unbroken run --nproc-per-node 1 examples/torchtitan/train.py \\
        --module titan_configs --config llama3_debug_unbroken --dump_folder runs/titan \\
        --training.steps 12 --checkpoint.data_on_reshard keep

Every argument after the script is torchtitan's own (``--training.steps 8``,
``--checkpoint.interval 4``...). Each rank prints a digest of its final parameters:
compare them with a run without ``--inject-fault``. Without CUDA, two shims let
torchtitan 0.3.0 run on CPU (see `_on_cpu`); nothing in torchtitan is changed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import unbroken.run


class _CPUDevice(types.ModuleType):
    """``torch.cpu`` plus the calls torchtitan makes on its device module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total)

    @staticmethod
    def current_device() -> int:
        return 0  # torch.cpu says "cpu", which barrier(device_ids=...) refuses

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _on_cpu() -> None:
    """torchtitan 0.3.0 falls back to "cuda" where no accelerator is found
    (torchtitan/tools/utils.py, ``get_device_info``), and calls
    ``torch.distributed.set_timeout``, which torch 2.13 does not have
    (torchtitan/distributed/utils.py, ``set_pg_timeouts``). Before any other torchtitan
    module binds them: the CPU as its device, and c10d's own ``_set_pg_timeout``."""
    import torchtitan.tools.utils as titan_utils

    if not torch.cuda.is_available():
        titan_utils.device_type, titan_utils.device_module = "cpu", _CPUDevice("cpu")
    if not hasattr(dist, "set_timeout"):
        from torch.distributed import distributed_c10d

        def set_timeout(timeout: timedelta, group: Any = None) -> None:
            distributed_c10d._set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout  # type: ignore[attr-defined]


_on_cpu()

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402

ARGS = sys.argv[1:]


def digest(model: torch.nn.Module) -> str:
    """A digest of this rank's parameters (each DTensor's local part)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train() -> None:
    """One generation: torchtitan builds its trainer (meshes, model, optimizer, the
    checkpoint manager) on this generation's process group, restores and trains."""
    config: Any = ConfigManager().parse_args(ARGS)
    trainer = config.build()
    trainer.train()  # restores first: healed from a live replica after a failure
    trainer.close()  # only after success: a failed generation is abandoned, not closed
    rank = dist.get_rank()
    # One write with its newline: ranks printing at once under `python -u` do not interleave.
    line = f"rank {rank}: step {trainer.step} params {digest(trainer.model_parts[0])}\n"
    sys.stdout.write(line)


init_logger()
unbroken.run.in_process(train)  # initialises the process group; reruns train() after a fault
