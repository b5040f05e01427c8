"""A snapshot every step, in bench/async_save.py: how long ``Checkpointer.snapshot`` keeps
training waiting, against a memcpy of the state into touched memory, and the training
throughput it costs against no snapshots, measured here and projected for a GPU.

The training step is the bench's CPU stand-in (async_save_run.Trainer) repeated to last
about ``STEP_S``: what a snapshot costs is a fixed time per step (the copy, plus the
checksum taking CPU from training in the background), so the fraction lost is that time
over the step time, and the table also gives the step time above which it stays under
the target. The projection for a GPU: the copy runs at ``GPU_D2H_GBPS`` (an assumption:
device-to-host into pageable shared memory, about half of PCIe Gen5 x16's pinned rate),
and the checksum runs on a host core, off the GPU's critical path.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import unbroken
from common import max_over_ranks

# the training step timed here: the stand-in step repeated to about this long (a smoke run
# may shorten it: UNBROKEN_BENCH_STEP_S=0.2)
STEP_S = float(os.environ.get("UNBROKEN_BENCH_STEP_S", "2.0"))
STEPS = 6  # timed steps per repeat, with and without a snapshot after each
WARM = 3  # snapshots before timing: each of the three slots is faulted in once
TARGET_BLOCK = 1.2  # snapshot's blocking time, as a multiple of the memcpy limit
TARGET_LOST = 0.05  # training throughput lost with a snapshot every step
GPU_D2H_GBPS = 25.0  # the projection's device-to-host copy rate (GB/s), see above
SHM = "/dev/shm"


class SnapshotBench:
    """One rank's snapshot-every-step measurement, on a checkpointer of its own whose
    snapshots live in a fresh folder of /dev/shm (removed by `close`)."""

    def __init__(self, root: str, state: dict[str, Any], step: Callable[[], float]) -> None:
        name = [f"unbroken-bench-{uuid.uuid4().hex[:8]}"]
        dist.broadcast_object_list(name)  # one folder for all ranks, as one node's memory
        self.shm = os.path.join(SHM if os.path.isdir(SHM) else root, name[0])
        self.ckpt = unbroken.Checkpointer(
            os.path.join(root, "snapshots"), memory=True, memory_dir=self.shm, job="bench"
        )
        self.state, self.unit = state, step
        self.units = 0
        self.next = 0

    def step(self) -> float:
        """One training step of about STEP_S (calibrated on first use, same on all ranks)."""
        if not self.units:
            one = statistics.median(self.unit() for _ in range(10))
            self.units = int(max_over_ranks(STEP_S / one)[0])
        start = time.perf_counter()
        for _ in range(self.units):
            self.unit()
        return time.perf_counter() - start

    def snapshot(self) -> float:
        self.next += 1
        start = time.perf_counter()
        self.ckpt.snapshot(self.next, self.state)
        return time.perf_counter() - start

    def measure(self, record: Callable[[str, float], None]) -> None:
        """Steps without snapshots, then steps with one after each; the figures of the
        slowest rank."""
        while self.next < WARM:
            self.snapshot()
        self.ckpt.wait()
        dist.barrier()
        base = [self.step() for _ in range(STEPS)]
        dist.barrier()
        with_snapshots, blocked = [], []
        for _ in range(STEPS):
            with_snapshots.append(self.step())
            blocked.append(self.snapshot())
            with_snapshots[-1] += blocked[-1]
        self.ckpt.wait()
        step, loaded, block = max_over_ranks(
            statistics.fmean(base), statistics.fmean(with_snapshots), statistics.median(blocked)
        )
        record("snapshot.block", block)
        record("snapshot.step", step)
        record("snapshot.overhead", max(0.0, loaded - step))
        record("snapshot.lost", max(0.0, loaded / step - 1))

    def close(self) -> None:
        self.ckpt.close()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self.shm, ignore_errors=True)


def snapshot_rows(
    best: dict[str, float], median: dict[str, float], memcpy: float, state_bytes: int
) -> tuple[list[tuple[str, ...]], dict[str, Any]]:
    """The table rows and the RESULT figures; ``memcpy``: the limit (s), ``state_bytes``:
    one rank's state."""
    block, lost, overhead = best["snapshot.block"], best["snapshot.lost"], best["snapshot.overhead"]
    ok_block, ok_lost = block <= TARGET_BLOCK * memcpy, lost < TARGET_LOST
    gpu_s = state_bytes / (GPU_D2H_GBPS * 1e9)
    gpu_lost = gpu_s / best["snapshot.step"]
    rows: list[tuple[str, ...]] = [
        (
            "snapshot every step",
            "blocking, ms",
            "",
            f"{block * 1e3:.1f}",
            f"{median['snapshot.block'] * 1e3:.1f}",
            f"{block / memcpy:.2f}x",
            f"{'PASS' if ok_block else 'FAIL'}: <= {TARGET_BLOCK:g}x memcpy",
        ),
        (
            "snapshot every step",
            f"throughput lost, {best['snapshot.step']:.1f} s step",
            "",
            f"{lost:.1%}",
            f"{median['snapshot.lost']:.1%}",
            f"{overhead * 1e3:.0f} ms/step",
            f"{'PASS' if ok_lost else 'FAIL'}: < {TARGET_LOST:.0%}; under it for steps "
            f">= {overhead / TARGET_LOST:.1f} s",
        ),
        (
            "snapshot every step",
            f"projected, GPU at {GPU_D2H_GBPS:g} GB/s D2H",
            "",
            f"{gpu_lost:.1%}",
            "",
            f"{gpu_s * 1e3:.0f} ms/step",
            "the copy only; checksums on a host core",
        ),
    ]
    figures = {
        "blocking_ms": {"best": block * 1e3, "median": median["snapshot.block"] * 1e3},
        "blocking_vs_memcpy": block / memcpy,
        "step_s": best["snapshot.step"],
        "overhead_ms_per_step": overhead * 1e3,
        "throughput_lost": {"best": lost, "median": median["snapshot.lost"]},
        "projected_gpu": {"d2h_gb_per_s": GPU_D2H_GBPS, "lost": gpu_lost, "copy_ms": gpu_s * 1e3},
        "pass": {"blocking": ok_block, "lost": ok_lost},
    }
    return rows, figures
