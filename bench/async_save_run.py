"""The timed part of bench/async_save.py: one rank's background saves (unbroken and DCP's
``async_save``), the disk limits beside them, and the training stand-in they compete with."""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import unbroken
from common import (
    GIB,
    MIB,
    PAUSE_S,
    DiskConfig,
    fresh_dir,
    hand_back,
    join_gloo,
    leave_group,
    make_state,
    max_over_ranks,
    raw_write,
    rotated,
    settle,
    timed,
)
from limits import aligned, striped_write
from unbroken.format.shards import packed
from unbroken.sdc import Replicated

WAIT_S = 120.0  # longest wait for a background save; a hang fails the run instead
# the training stand-in: LAYERS x REPEAT single-threaded (BATCH x HIDDEN) @ (HIDDEN x HIDDEN)
BATCH, HIDDEN, LAYERS, REPEAT = 64, 256, 4, 4
BASE_STEPS = 40  # steps timed with nothing in the background, before each save
# A training script's first save comes after its first steps, at least: the staging that
# `Checkpointer.prepare` allocates and touches in the background (0.3 to 1.2 s for 512 MiB
# on this VM, whose page faults are slow) is ready by then. The first timed save comes
# this long after `prepare`, so "first" measures a first save, not the preparation.
PREPARED_S = 3.0
DCP_MODES = {
    "dcp_thread": AsyncCheckpointerType.THREAD,
    "dcp_process": AsyncCheckpointerType.PROCESS,
}
LABELS = {
    "unbroken": "unbroken, blocking=False",
    "dcp_thread": "DCP async_save, thread",
    "dcp_process": "DCP async_save, process",
}
TRAINED = ("unbroken", "dcp_thread")  # the methods timed under training


# --------------------------------------------------------------------------- saves


@dataclass(frozen=True)
class Pending:
    """A background save, whichever library started it."""

    done: Callable[[], bool]
    wait: Callable[[], None]


def save_unbroken(ckpt: unbroken.Checkpointer, step: int, state: dict[str, Any]) -> Pending:
    handle = ckpt.save(step, state, blocking=False)

    def wait() -> None:
        if not handle.wait(WAIT_S):
            raise AssertionError(f"unbroken skipped step {step}")

    return Pending(handle.done, wait)


def save_dcp(
    state: dict[str, Any], path: str, mode: AsyncCheckpointerType, group: dist.ProcessGroup
) -> Pending:
    got = dcp.async_save(
        state,
        storage_writer=dcp.FileSystemWriter(path),  # fsyncs its files: durable when done
        process_group=group,
        async_checkpointer_type=mode,
    )
    future = got.upload_completion if isinstance(got, AsyncSaveResponse) else got
    return Pending(future.done, lambda: future.result(WAIT_S))


# --------------------------------------------------------------------------- training


class Trainer:
    """A CPU-bound stand-in for a training step: a fixed chain of small matmuls on this
    rank's one thread. Like real training, each op releases the GIL while it computes and
    needs it back in between, so background Python threads compete with it too."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.weights = [
            torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5 for _ in range(LAYERS)
        ]
        self.x = torch.randn(BATCH, HIDDEN, generator=gen)

    def step(self) -> float:
        start = time.perf_counter()
        x = self.x
        for _ in range(REPEAT):
            for w in self.weights:
                x = torch.tanh(x @ w)
        return time.perf_counter() - start


# --------------------------------------------------------------------------- one rank


def join(rank: int, cfg: DiskConfig) -> None:
    """This process's setup, then the default group (also for the memory workers)."""
    torch.set_num_threads(1)
    # DCP's process mode starts one daemon per rank that meets the others at MASTER_ADDR
    # (default: this host's name, which need not resolve here)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    join_gloo(rank, cfg.ranks, cfg.port, timeout_s=120)


class AsyncRank:
    """One rank of the timed run: every method once per repeat, interleaved."""

    def __init__(self, rank: int, cfg: DiskConfig, sdc_off: bool = False) -> None:
        self.rank, self.cfg = rank, cfg
        self.root = Path(cfg.dir)
        self.state = make_state(rank, cfg.mib_per_rank * MIB)
        self.tensors = list(self.state["model"].values())
        self.nbytes = sum(t.nbytes for t in self.tensors)
        # touched before any timing: the memcpy limit's destination, then the raw writers'
        # source
        self.flat = torch.zeros(self.nbytes, dtype=torch.uint8)
        self.aligned = torch.zeros(packed(t.nbytes for t in self.tensors)[1], dtype=torch.uint8)
        self.flat_mv = self.flat.numpy().data
        self.direct_mv = aligned(self.flat_mv)  # the direct writer's source: page-aligned
        # DCP's collectives run on a group of their own, apart from this script's barriers
        self.dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
        self.trainer = Trainer(rank)
        off = Replicated(auto=False) if sdc_off else None  # the default compares replicas
        self.ckpt = unbroken.Checkpointer(self.root / "unbroken", replicated=off)  # collective
        # what a training script does before its loop: staging allocated and touched in the
        # background, so the first save blocks like the later ones (Checkpointer.prepare)
        self.ckpt.prepare(self.state)
        prepared_at = time.monotonic()
        self.saves = itertools.count(1000)  # steps only go forward (a lower one is refused)
        self.samples: dict[str, list[float]] = {}
        self.unavailable: dict[str, str] = {}
        # a pause in proportion to the bytes just written (1 s per GiB, at most 1 s)
        self.pause_s = PAUSE_S * min(1.0, cfg.total_bytes / GIB)
        time.sleep(max(0.0, PREPARED_S - (time.monotonic() - prepared_at)))

    def record(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def settle(self, *paths: Path) -> None:
        settle(*paths, pause_s=self.pause_s)

    def memcpy(self, into: torch.Tensor) -> None:
        """Typed copies of the state to aligned offsets of ``into``: the fastest way any
        method here copies (unbroken's staging copies the same way)."""
        offsets = packed(t.nbytes for t in self.tensors)[0]
        for t, o in zip(self.tensors, offsets, strict=True):
            into[o : o + t.nbytes].view(t.dtype).view(t.shape).copy_(t)

    def limits(self, rep: int) -> None:
        rank, root, tensors, flat_mv = self.rank, self.root, self.tensors, self.flat_mv

        memcpy, aligned_bytes = self.memcpy, packed(t.nbytes for t in tensors)[1]
        # the limit is a best case: sampled three times here, and once before every
        # method's turn (`run`), so that it sees the machine's quiet moments as they do
        self.record("block.memcpy", min(timed(lambda: memcpy(self.aligned)) for _ in range(3)))
        # what any first save pays: page faults on memory never touched before
        fresh: list[torch.Tensor] = []

        def memcpy_fresh() -> None:
            fresh.append(torch.empty(aligned_bytes, dtype=torch.uint8))
            memcpy(fresh[-1])

        self.record("block.memcpy_fresh", timed(memcpy_fresh))
        fresh.clear()  # freed off the clock, as a save frees its staging copy later
        plain = f"{fresh_dir(root / 'raw' / str(rep))}/rank{rank}.bin"
        early = f"{fresh_dir(root / 'raw' / f'{rep}-early')}/rank{rank}.bin"
        striped = f"{fresh_dir(root / 'raw' / f'{rep}-striped')}/rank{rank}.bin"
        direct = f"{fresh_dir(root / 'raw' / f'{rep}-direct')}/rank{rank}.bin"
        writers = [
            ("write_fsync", lambda: raw_write(plain, flat_mv)),
            ("write_fsync_early", lambda: raw_write(early, flat_mv, True)),
            ("write_fsync_striped", lambda: striped_write(striped, flat_mv)),
            ("write_direct_striped", lambda: striped_write(direct, self.direct_mv, direct=True)),
        ]
        for i, (name, write) in enumerate(rotated(writers, rep)):
            if i:  # the order rotates; the first one follows the last method's settle
                self.settle()
            self.record(f"durable.{name}", timed(write))

    def round_trip(self, method: str, start: Callable[[], Pending]) -> None:
        """One save, timed until it returns and until it is committed."""
        failure = ""
        dist.barrier()
        begin = time.perf_counter()
        try:
            pending = start()
            blocked = time.perf_counter() - begin
            pending.wait()
            durable = time.perf_counter() - begin
        except Exception as e:
            if method != "dcp_process":
                raise
            failure, blocked, durable = f"{type(e).__name__}: {e}", 0.0, 0.0
        blocked, durable, failed = max_over_ranks(blocked, durable, float(bool(failure)))
        if failed:  # every rank agrees, so every rank skips this method from now on
            self.unavailable[method] = failure or "failed on another rank"
            return
        self.record(f"block.{method}", blocked)
        self.record(f"durable.{method}", durable)

    def under_training(self, method: str, start: Callable[[], Pending]) -> None:
        """Train with nothing in the background, then while one save persists."""
        trainer = self.trainer
        dist.barrier()
        base = [trainer.step() for _ in range(BASE_STEPS)]
        dist.barrier()
        begin = time.perf_counter()
        pending = start()
        blocked = time.perf_counter() - begin
        during = []
        while not pending.done():
            during.append(trainer.step())
        pending.wait()
        window = time.perf_counter() - begin - blocked
        step = statistics.fmean(base)
        slowdown = statistics.fmean(during) / step - 1 if during else 0.0
        lost = sum(during) - len(during) * step  # what the save cost training, in seconds
        blocked, slowdown, lost, window, base_ms = max_over_ranks(
            blocked, slowdown, lost, window, step * 1e3
        )
        self.record(f"block.{method}", blocked)  # the save's blocking time, idle as in round_trip
        self.record(f"slowdown.{method}", slowdown)
        self.record(f"lost.{method}", lost)
        self.record(f"window.{method}", window)
        self.record("step_ms", base_ms)

    def unbroken_async(self, rep: int) -> None:
        self.round_trip("unbroken", self.save_next)

    def dcp_async(self, method: str) -> Callable[[int], None]:
        def run(rep: int) -> None:
            if method in self.unavailable:
                return
            path = fresh_dir(self.root / method / str(rep))
            mode, state, group = DCP_MODES[method], self.state, self.dcp_group
            self.round_trip(method, lambda: save_dcp(state, path, mode, group))

        return run

    def train_unbroken(self, rep: int) -> None:
        self.under_training("unbroken", self.save_next)

    def save_next(self) -> Pending:
        return save_unbroken(self.ckpt, next(self.saves), self.state)

    def train_dcp_thread(self, rep: int) -> None:
        path = fresh_dir(self.root / "train_dcp" / str(rep))
        mode, state, group = AsyncCheckpointerType.THREAD, self.state, self.dcp_group
        self.under_training("dcp_thread", lambda: save_dcp(state, path, mode, group))

    def run(self) -> dict[str, Any]:
        # In the first repeat every method's first call is a round_trip: "first" is a clean
        # sample
        methods = [
            self.unbroken_async,
            self.dcp_async("dcp_thread"),
            self.dcp_async("dcp_process"),
            self.limits,
            self.train_unbroken,
            self.train_dcp_thread,
        ]
        root = self.root
        junk = [root / sub for sub in ("raw", "dcp_thread", "dcp_process", "train_dcp")]
        self.settle()
        for rep in range(self.cfg.repeats):
            for method in rotated(methods, rep):  # each method runs in each slot over time
                self.record("block.memcpy", timed(lambda: self.memcpy(self.aligned)))
                method(rep)
                # nothing in flight now: unbroken's committed steps can go with the rest
                self.settle(*junk, *(root / "unbroken").glob("step-*"))
            if self.rank == 0:
                last = ", ".join(
                    f"{k} {v[-1] * 1e3:.0f} ms"
                    for k, v in self.samples.items()
                    if k.startswith("block.")
                )
                print(f"repeat {rep + 1}/{self.cfg.repeats}, blocking: {last}", flush=True)
        return {"samples": self.samples, "unavailable": self.unavailable}


def worker(rank: int, cfg: DiskConfig, sdc_off: bool = False) -> None:
    join(rank, cfg)
    bench = AsyncRank(rank, cfg, sdc_off)
    hand_back(cfg.dir, bench.run())
    bench.ckpt.close()
    leave_group()
    if "dcp_process" in bench.unavailable:
        # a daemon that never came up leaves DCP's executor thread waiting (30 min): go now
        os._exit(0)
