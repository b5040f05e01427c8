"""Peak memory of bench/async_save.py's methods: a fresh process per method and rank, two
background saves, then a check that both restore the state as it was when saved."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import unbroken
from async_save_run import DCP_MODES, Pending, join, save_dcp, save_unbroken
from common import MIB, DiskConfig, as_bytes, fresh_dir, hand_back, leave_group, make_state

MEMORY = ("unbroken", "dcp_thread")  # the methods whose peak RSS is measured


def vm(field: str) -> int:
    """A ``Vm*`` figure of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def result_file(method: str) -> str:
    return f"memory-{method}.json"


class MemoryRank:
    """One rank of one method's memory run; ``ckpt`` (unbroken) or ``group`` (DCP)."""

    def __init__(self, rank: int, cfg: DiskConfig, method: str) -> None:
        self.rank, self.cfg, self.method = rank, cfg, method
        self.root = Path(cfg.dir) / f"memory-{method}"
        self.ckpt: unbroken.Checkpointer | None = None
        self.group: dist.ProcessGroup | None = None
        if method == "unbroken":
            self.ckpt = unbroken.Checkpointer(self.root)
        else:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        if self.ckpt is not None:
            return save_unbroken(self.ckpt, step, state)
        assert self.group is not None
        path = fresh_dir(self.root / str(step))
        return save_dcp(state, path, DCP_MODES[self.method], self.group)

    def peaks(self, state: dict[str, Any], tensors: list[torch.Tensor]) -> list[int]:
        """VmHWM after each of two saves, the live tensors changed as soon as each
        returns."""
        peaks = []
        for step in (1, 2):
            dist.barrier()
            pending = self.start(step, state)
            for t in tensors:
                t.neg_()  # training moves on at once; exact, and undone below
            pending.wait()
            for t in tensors:
                t.neg_()
            peaks.append(vm("VmHWM"))
        return peaks

    def restores(self, state: dict[str, Any], tensors: list[torch.Tensor]) -> bool:
        """Both steps restored into zeroed tensors equal the state as saved; the reference
        is regenerated (same seed), after the peak is read."""
        reference = list(make_state(self.rank, self.cfg.mib_per_rank * MIB)["model"].values())
        restored = []
        for step in (1, 2):
            for t in tensors:
                t.zero_()  # a restore that writes nothing must fail the check
            dist.barrier()
            if self.ckpt is not None:
                got = self.ckpt.restore(state, step=step)
                if got != step:
                    raise AssertionError(f"unbroken restored step {got}, not {step}")
            else:
                dcp.load(state, checkpoint_id=str(self.root / str(step)), process_group=self.group)
            restored.append(
                all(
                    torch.equal(as_bytes(t), as_bytes(r))
                    for t, r in zip(tensors, reference, strict=True)
                )
            )
        return all(restored)


def memory_worker(rank: int, cfg: DiskConfig, method: str) -> None:
    """A fresh process per method, so peaks of other methods do not count: two saves, the
    live tensors changed as soon as each returns, then both restored and checked."""
    join(rank, cfg)
    bench = MemoryRank(rank, cfg, method)
    baseline = vm("VmRSS")  # the interpreter, torch and the process groups
    state = make_state(rank, cfg.mib_per_rank * MIB)
    tensors = list(state["model"].values())
    state_bytes = sum(t.nbytes for t in tensors)
    if bench.ckpt is not None:
        bench.ckpt.prepare(state)  # staging ahead, as in the timed run: counted in the peaks
    peaks = bench.peaks(state, tensors)
    restored = bench.restores(state, tensors)
    if bench.ckpt is not None:
        bench.ckpt.close()
    row = {
        "baseline": baseline,
        "peak_first": peaks[0],
        "peak": peaks[1],
        "state": state_bytes,
        "restored": restored,
    }
    rows: list[dict[str, Any]] = [{} for _ in range(cfg.ranks)]
    dist.all_gather_object(rows, row)
    hand_back(cfg.dir, rows, result_file(method))
    leave_group()
