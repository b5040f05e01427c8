"""Background saves: unbroken's ``save(blocking=False)`` against
``torch.distributed.checkpoint.async_save`` (thread and process modes), next to this machine's
limits measured in the same run, on the same state as bench/save_load.py.

    python bench/async_save.py                                  # 2 ranks x 512 MiB, 5 repeats
    python bench/async_save.py --mib-per-rank 32 --repeats 2    # smoke, well under a minute

Four questions, each answered per rank and reported for the slowest rank:

1. blocking time: how long ``save`` keeps training waiting (until the state is copied and the
   tensors may change), first call and steady state, next to a bare memcpy of the same bytes
   into an already-touched buffer (the limit) and into fresh memory (what a first call pays);
2. time to durable: from the call until the checkpoint is committed, as aggregate GiB/s, next
   to a raw sequential write + fsync of the same bytes by every rank at once;
3. training slowdown: step time of a single-threaded, CPU-bound loop while a save persists,
   against the same loop with nothing in the background. The machine has 2 cores and each of
   the 2 ranks keeps one busy, so background persistence can only take cycles from training;
4. peak RSS per rank in a fresh process per method, and a restore check: the live tensors are
   changed right after ``save`` returns, and the checkpoint must still hold the old values.

Methods are interleaved (order rotates each repeat, disk flushed and a pause between them):
disk speed on this VM varies a lot between runs, so best and median are both reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import unbroken
from save_load import (
    GIB,
    MIB,
    PAUSE_S,
    TARGET_OF_LIMIT,
    Config,
    as_bytes,
    flat_views,
    free_port,
    fresh_dir,
    make_state,
    on_tmpfs,
    raw_write,
    timed,
)

# DCP's process-mode daemon (which imports this file) logs every request at INFO on stderr
logging.disable(logging.INFO)

TARGET_VS_MEMCPY = 1.5  # blocking time at most this multiple of the memcpy limit
TARGET_VS_DCP = 1 / 3  # ... and at most this fraction of DCP's blocking time
TARGET_RSS = 2.2  # peak memory per rank, in state sizes (state + one staging copy + slack)
WAIT_S = 120.0  # longest wait for a background save; a hang fails the run instead
# the training stand-in: LAYERS x REPEAT single-threaded (BATCH x HIDDEN) @ (HIDDEN x HIDDEN)
BATCH, HIDDEN, LAYERS, REPEAT = 64, 256, 4, 4
BASE_STEPS = 40  # steps timed with nothing in the background, before each save
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
MEMORY = ("unbroken", "dcp_thread")  # the methods whose peak RSS is measured


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


def settle(cfg: Config, *paths: Path) -> None:
    """save_load.quiesce with a pause in proportion to the bytes just written (1 s per GiB,
    at most 1 s): delete ``paths`` (rank 0), flush the disk, let its burst speed recover."""
    if dist.get_rank() == 0:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        os.sync()
        time.sleep(PAUSE_S * min(1.0, cfg.total_bytes / GIB))
    dist.barrier()


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


# --------------------------------------------------------------------------- main run


def init(rank: int, cfg: Config) -> None:
    torch.set_num_threads(1)
    # DCP's process mode starts one daemon per rank that meets the others at MASTER_ADDR
    # (default: this host's name, which need not resolve here)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg.port}",
        rank=rank,
        world_size=cfg.ranks,
        timeout=timedelta(seconds=120),
    )


def max_over_ranks(*values: float) -> list[float]:
    out = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return [float(v) for v in out.tolist()]


def worker(rank: int, cfg: Config) -> None:
    init(rank, cfg)
    root = Path(cfg.dir)
    state = make_state(rank, cfg.mib_per_rank * MIB)
    tensors = list(state["model"].values())
    nbytes = sum(t.nbytes for t in tensors)
    # touched before any timing: the memcpy limit's destination, then the raw writers' source
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    flat_mv = flat.numpy().data
    # DCP's collectives run on a group of their own, apart from this script's barriers
    dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    ckpt = unbroken.Checkpointer(root / "unbroken")  # collective; its own group too
    trainer = Trainer(rank)
    samples: dict[str, list[float]] = {}
    unavailable: dict[str, str] = {}

    def record(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    def limits(rep: int) -> None:
        def memcpy(into: torch.Tensor) -> None:
            for t, view in zip(tensors, flat_views(into, tensors), strict=True):
                view.copy_(as_bytes(t))

        record("block.memcpy", timed(lambda: memcpy(flat)))
        # what any first save pays: page faults on memory never touched before
        fresh: list[torch.Tensor] = []

        def memcpy_fresh() -> None:
            fresh.append(torch.empty(nbytes, dtype=torch.uint8))
            memcpy(fresh[-1])

        record("block.memcpy_fresh", timed(memcpy_fresh))
        fresh.clear()  # freed off the clock, as a save frees its staging copy later
        plain = f"{fresh_dir(root / 'raw' / str(rep))}/rank{rank}.bin"
        early = f"{fresh_dir(root / 'raw' / f'{rep}-early')}/rank{rank}.bin"
        writers = [("write_fsync", plain, False), ("write_fsync_early", early, True)]
        for i, (name, where, early_writeback) in enumerate(writers[:: 1 if rep % 2 else -1]):
            if i:  # alternate the order; the first one follows the last method's settle
                settle(cfg)
            seconds = timed(lambda: raw_write(where, flat_mv, early_writeback))  # noqa: B023
            record(f"durable.{name}", seconds)

    def round_trip(method: str, start: Callable[[], Pending]) -> None:
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
            unavailable[method] = failure or "failed on another rank"
            return
        record(f"block.{method}", blocked)
        record(f"durable.{method}", durable)

    def under_training(method: str, start: Callable[[], Pending]) -> None:
        """Train with nothing in the background, then while one save persists."""
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
        record(f"block.{method}", blocked)  # the save's blocking time, idle as in round_trip
        record(f"slowdown.{method}", slowdown)
        record(f"lost.{method}", lost)
        record(f"window.{method}", window)
        record("step_ms", base_ms)

    def unbroken_async(rep: int) -> None:
        round_trip("unbroken", lambda: save_unbroken(ckpt, 1000 + rep, state))

    def dcp_async(method: str) -> Callable[[int], None]:
        def run(rep: int) -> None:
            if method in unavailable:
                return
            path = fresh_dir(root / method / str(rep))
            round_trip(method, lambda: save_dcp(state, path, DCP_MODES[method], dcp_group))

        return run

    def train_unbroken(rep: int) -> None:
        under_training("unbroken", lambda: save_unbroken(ckpt, 2000 + rep, state))

    def train_dcp_thread(rep: int) -> None:
        path = fresh_dir(root / "train_dcp" / str(rep))
        mode = AsyncCheckpointerType.THREAD
        under_training("dcp_thread", lambda: save_dcp(state, path, mode, dcp_group))

    # In the first repeat every method's first call is a round_trip: "first" is a clean sample
    methods = [
        unbroken_async,
        dcp_async("dcp_thread"),
        dcp_async("dcp_process"),
        limits,
        train_unbroken,
        train_dcp_thread,
    ]
    junk = [root / sub for sub in ("raw", "dcp_thread", "dcp_process", "train_dcp")]
    settle(cfg)
    for rep in range(cfg.repeats):
        shift = rep % len(methods)  # interleave: each method runs in each slot over time
        for method in methods[shift:] + methods[:shift]:
            method(rep)
            # nothing in flight now: unbroken's committed steps can go with the rest
            settle(cfg, *junk, *(root / "unbroken").glob("step-*"))
        if rank == 0:
            last = ", ".join(
                f"{k} {v[-1] * 1e3:.0f} ms" for k, v in samples.items() if k.startswith("block.")
            )
            print(f"repeat {rep + 1}/{cfg.repeats}, blocking: {last}", flush=True)

    if rank == 0:
        out = {"samples": samples, "unavailable": unavailable}
        (root / "result.json").write_text(json.dumps(out))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    if "dcp_process" in unavailable:
        # a daemon that never came up leaves DCP's executor thread waiting (30 min): go now
        os._exit(0)


# --------------------------------------------------------------------------- memory


def vm(field: str) -> int:
    """A ``Vm*`` figure of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def memory_worker(rank: int, cfg: Config, method: str) -> None:
    """A fresh process per method, so peaks of other methods do not count: two saves, the
    live tensors changed as soon as each returns, then both restored and checked."""
    init(rank, cfg)
    root = Path(cfg.dir) / f"memory-{method}"
    if method == "unbroken":
        ckpt = unbroken.Checkpointer(root)
    else:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    baseline = vm("VmRSS")  # the interpreter, torch and the process groups
    state = make_state(rank, cfg.mib_per_rank * MIB)
    tensors = list(state["model"].values())
    state_bytes = sum(t.nbytes for t in tensors)

    def start(step: int) -> Pending:
        if method == "unbroken":
            return save_unbroken(ckpt, step, state)
        path = fresh_dir(root / str(step))
        return save_dcp(state, path, DCP_MODES[method], group)

    peaks = []
    for step in (1, 2):
        dist.barrier()
        pending = start(step)
        for t in tensors:
            t.neg_()  # training moves on at once; exact, and undone below
        pending.wait()
        for t in tensors:
            t.neg_()
        peaks.append(vm("VmHWM"))

    # Correctness, after the peak is read: the reference is regenerated (same seed)
    reference = list(make_state(rank, cfg.mib_per_rank * MIB)["model"].values())
    restored = []
    for step in (1, 2):
        for t in tensors:
            t.zero_()  # a restore that writes nothing must fail the check
        dist.barrier()
        if method == "unbroken":
            got = ckpt.restore(state, step=step)
            if got != step:
                raise AssertionError(f"unbroken restored step {got}, not {step}")
        else:
            dcp.load(state, checkpoint_id=str(root / str(step)), process_group=group)
        restored.append(
            all(
                torch.equal(as_bytes(t), as_bytes(r))
                for t, r in zip(tensors, reference, strict=True)
            )
        )
    if method == "unbroken":
        ckpt.close()
    row = {
        "baseline": baseline,
        "peak_first": peaks[0],
        "peak": peaks[1],
        "state": state_bytes,
        "restored": all(restored),
    }
    rows: list[dict[str, Any]] = [{} for _ in range(cfg.ranks)]
    dist.all_gather_object(rows, row)
    if rank == 0:
        (Path(cfg.dir) / f"memory-{method}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- report


LIMITS = ("block.memcpy", "block.memcpy_fresh", "durable.write_fsync", "durable.write_fsync_early")
Row = tuple[str, ...]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(
    cfg: Config, raw: dict[str, Any], memory: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    samples: dict[str, list[float]] = raw["samples"]
    unavailable: dict[str, str] = raw["unavailable"]
    methods = [m for m in LABELS if m not in unavailable]
    gib = cfg.total_bytes / GIB

    def steady(key: str, values: list[float]) -> list[float]:
        """A method's saves after the first (which allocates); every sample of the rest."""
        is_save = key.startswith(("block.", "durable.")) and key not in LIMITS
        return values[1:] if is_save else values

    # seconds, or fractions for slowdowns
    first = {k: v[0] for k, v in samples.items()}
    best = {k: min(steady(k, v)) for k, v in samples.items()}  # least time, least slowdown
    median = {k: statistics.median(steady(k, v)) for k, v in samples.items()}
    memcpy = best["block.memcpy"]
    write_limit = min(best["durable.write_fsync"], best["durable.write_fsync_early"])
    # against the faster DCP mode that ran: the stricter comparison
    dcp_first = min(first[f"block.{m}"] for m in methods if m.startswith("dcp"))
    dcp_steady = min(best[f"block.{m}"] for m in methods if m.startswith("dcp"))

    def ms(key: str, pick: dict[str, float]) -> str:
        return f"{pick[key] * 1e3:.1f}"

    def rate(key: str, pick: dict[str, float]) -> str:
        return f"{gib / pick[key]:.2f}"

    checks: dict[str, bool] = {}
    speed: list[Row] = []
    for key, label in (
        ("memcpy", "limit: memcpy, touched buffer"),
        ("memcpy_fresh", "memcpy, fresh memory"),
    ):
        key = f"block.{key}"
        ratio = f"{best[key] / memcpy:.1f}x"
        speed.append(("blocking, ms", label, "", ms(key, best), ms(key, median), ratio, ""))
    for m, label in LABELS.items():
        key = f"block.{m}"
        if m in unavailable:
            speed.append(("blocking, ms", label, "n/a", "n/a", "n/a", "", unavailable[m][:70]))
            continue
        lines = []
        if m == "unbroken":
            for when, value, dcp_value in (
                ("first", first[key], dcp_first),
                ("steady", best[key], dcp_steady),
            ):
                vs_memcpy, vs_dcp = value / memcpy, value / dcp_value
                checks[f"blocking_{when}"] = ok = (
                    vs_memcpy <= TARGET_VS_MEMCPY and vs_dcp <= TARGET_VS_DCP
                )
                lines.append(
                    f"{verdict(ok)} {when}: {vs_memcpy:.2f}x memcpy (<= {TARGET_VS_MEMCPY:g}x), "
                    f"{vs_dcp:.2f}x DCP (<= {TARGET_VS_DCP:.2f}x)"
                )
            # what bounds them: memcpy is as fast as a copy gets, a first call must fault in
            # fresh memory
            lines.append(
                f"(memcpy is {memcpy / dcp_steady:.2f}x DCP steady; first is "
                f"{first[key] / best['block.memcpy_fresh']:.1f}x the best fresh memcpy)"
            )
        figures = ms(key, first), ms(key, best), ms(key, median), f"{best[key] / memcpy:.1f}x"
        speed.append(("blocking, ms", label, *figures, "\n".join(lines)))
    for key, label in (
        ("write_fsync", "limit: write + fsync"),
        ("write_fsync_early", "limit: write + fsync, early writeback"),
    ):
        key = f"durable.{key}"
        speed.append(("durable, GiB/s", label, "", rate(key, best), rate(key, median), "", ""))
    of_limit: dict[str, float] = {}
    for m in methods:
        key = f"durable.{m}"
        of_limit[m] = write_limit / best[key]
        target = ""
        if m == "unbroken":
            checks["durable"] = ok = of_limit[m] >= TARGET_OF_LIMIT
            target = f"{verdict(ok)}: {of_limit[m]:.0%} of write (>= {TARGET_OF_LIMIT:.0%})"
        rates = rate(key, first), rate(key, best), rate(key, median), f"{of_limit[m]:.0%}"
        speed.append(("durable, GiB/s", LABELS[m], *rates, target))
    step = f"{best['step_ms']:.2f}", f"{median['step_ms']:.2f}"
    speed.append(("training step, ms", "no save running", "", *step, "", ""))
    for m in TRAINED:
        key = f"slowdown.{m}"
        slowdowns = f"{best[key]:+.0%}", f"{median[key]:+.0%}"
        speed.append(("step slowdown, persisting", LABELS[m], "", *slowdowns, "", ""))
    for m in TRAINED:
        key = f"lost.{m}"
        lost = f"{best[key] * 1e3:.0f}", f"{median[key] * 1e3:.0f}"
        speed.append(("training lost per save, ms", LABELS[m], "", *lost, "", ""))

    rss: dict[str, dict[str, Any]] = {}
    mem_rows: list[Row] = []
    for m, rows in memory.items():
        # per rank, in state sizes; "added" leaves out what the process held before the state
        rss[m] = {
            "state_mib": max(r["state"] for r in rows) / MIB,
            "baseline_mib": max(r["baseline"] for r in rows) / MIB,
            "added_first": max((r["peak_first"] - r["baseline"]) / r["state"] for r in rows),
            "added": max((r["peak"] - r["baseline"]) / r["state"] for r in rows),
            "raw": max(r["peak"] / r["state"] for r in rows),
            "restored": all(r["restored"] for r in rows),
        }
        target = ""
        if m == "unbroken":
            checks["rss"] = ok = rss[m]["added"] <= TARGET_RSS
            checks["restore"] = rss[m]["restored"]
            target = f"{verdict(ok)}: added <= {TARGET_RSS:g}x"
        mem_rows.append(
            (
                LABELS[m],
                f"{rss[m]['state_mib']:.0f}",
                f"{rss[m]['baseline_mib']:.0f}",
                f"{rss[m]['added_first']:.2f}x",
                f"{rss[m]['added']:.2f}x",
                f"{rss[m]['raw']:.2f}x",
                verdict(rss[m]["restored"]),
                target,
            )
        )
    print_tables(cfg, speed, mem_rows)

    def summary(key: str, scale: Callable[[float], float]) -> dict[str, float]:
        out = {"best": scale(best[key]), "median": scale(median[key])}
        return out if key in LIMITS else {"first": scale(first[key])} | out

    def to_ms(s: float) -> float:
        return s * 1e3

    def to_rate(s: float) -> float:
        return gib / s

    return {
        "config": asdict(cfg) | {"total_bytes": cfg.total_bytes},
        "statistic": "first call; best and median of the later calls (limits: of all)",
        "unavailable": unavailable,
        "blocking_ms": {
            m: summary(f"block.{m}", to_ms) for m in ("memcpy", "memcpy_fresh", *methods)
        },
        "durable_gib_per_s": {
            m: summary(f"durable.{m}", to_rate)
            for m in ("write_fsync", "write_fsync_early", *methods)
        },
        "limits": {"memcpy_ms": memcpy * 1e3, "write_gib_per_s": gib / write_limit},
        "memcpy_vs_dcp_steady": memcpy / dcp_steady,
        "durable_of_write_limit": of_limit,
        "train_step_ms": {"best": best["step_ms"], "median": median["step_ms"]},
        "slowdown": {
            m: {"best": best[f"slowdown.{m}"], "median": median[f"slowdown.{m}"]} for m in TRAINED
        },
        "training_lost_ms_per_save": {
            m: {"best": best[f"lost.{m}"] * 1e3, "median": median[f"lost.{m}"] * 1e3}
            for m in TRAINED
        },
        "memory_per_rank_over_state": rss,
        "samples": samples,
        "targets": {
            "blocking_vs_memcpy": TARGET_VS_MEMCPY,
            "blocking_vs_dcp": TARGET_VS_DCP,
            "rss_added_over_state": TARGET_RSS,
            "durable_of_write_limit": TARGET_OF_LIMIT,
        },
        "pass": checks,
    }


def print_tables(cfg: Config, speed: list[Row], memory: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=175)
    table = Table(
        title=f"{cfg.ranks} ranks x {cfg.mib_per_rank} MiB, {cfg.repeats} repeats, {cfg.dir}",
        caption="slowest rank; first = first call, best/median = later calls; blocking: until "
        "save returns; durable: until committed (fsynced), aggregate GiB/s; slowdown: mean "
        "step time while a save persists vs none just before; lost: step time beyond that "
        "baseline, summed over the save. 2 ranks train on 2 cores: a save's threads and the "
        "kernel's page-cache work can only take cycles from training",
    )
    for name in ("measure", "method", "first", "best", "median", "vs limit", "target"):
        table.add_column(
            name, justify="left" if name in ("measure", "method", "target") else "right"
        )
    for i, row in enumerate(speed):
        if i and row[0] != speed[i - 1][0]:
            table.add_section()
        table.add_row(*row)
    console.print(table)

    table = Table(
        title="peak RSS per rank, a fresh process per method, two saves",
        caption="added = (VmHWM - RSS before the state existed) / state size; raw = VmHWM / "
        "state size; restore: every tensor changed right after save returned, both steps "
        "restored into zeroed tensors and equal to the state as saved",
    )
    for name in (
        "method",
        "state MiB",
        "before MiB",
        "added, 1 save",
        "added, 2 saves",
        "raw",
        "restore",
        "target",
    ):
        table.add_column(name, justify="left" if name in ("method", "target") else "right")
    for row in memory:
        table.add_row(*row)
    console.print(table)


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="the first call + steady state")
    parser.add_argument("--dir", help="on a real disk (default: a temp dir under /tmp or the repo)")
    args = parser.parse_args()
    if args.mib_per_rank < 16 or args.ranks < 1 or args.repeats < 2:
        parser.error("need --mib-per-rank >= 16, --ranks >= 1, --repeats >= 2")

    repo = Path(__file__).resolve().parent.parent
    parent = args.dir or (tempfile.gettempdir() if not on_tmpfs(tempfile.gettempdir()) else repo)
    Path(parent).mkdir(parents=True, exist_ok=True)
    if on_tmpfs(parent):
        parser.error(f"{parent} is in memory (tmpfs); pick a directory on a disk")
    workdir = tempfile.mkdtemp(prefix="unbroken-async-", dir=parent)
    cfg = Config(args.ranks, args.mib_per_rank, args.repeats, workdir, free_port())
    need = cfg.total_bytes * 4 * 1.1  # a few saves on disk at once, at most
    if shutil.disk_usage(workdir).free < need:
        parser.error(f"{workdir} needs {need / GIB:.1f} GiB free")
    try:
        mp.spawn(worker, args=(cfg,), nprocs=cfg.ranks, join=True)
        raw = json.loads((Path(workdir) / "result.json").read_text())
        # Peaks are per process, so both methods' fresh processes may run at once (their
        # timings are not reported)
        ports: list[int] = []
        while len(ports) < len(MEMORY):
            if (port := free_port()) not in ports:
                ports.append(port)
        spawned = [
            mp.spawn(
                memory_worker,
                args=(Config(cfg.ranks, cfg.mib_per_rank, cfg.repeats, workdir, port), method),
                nprocs=cfg.ranks,
                join=False,
            )
            for method, port in zip(MEMORY, ports, strict=True)
        ]
        for context in spawned:
            while not context.join():
                pass
        memory = {m: json.loads((Path(workdir) / f"memory-{m}.json").read_text()) for m in MEMORY}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = report(cfg, raw, memory)
    print("RESULT " + json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
