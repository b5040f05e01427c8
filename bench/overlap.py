"""Overlapped saves: unbroken's background save with its copy beside the next forward and
backward (`unbroken.job.overlap`), the same save copied before it returns
(``overlap=False``), DCP's ``async_save`` with its ``DefaultStager`` staging in the
background (thread and process writers), and torch-checkpointing's ``CheckpointManager``
(PyPI 0.1.1, ``pip install torch-checkpointing``; buffered writes: its O_DIRECT default
fails on this disk; it never calls fsync, so its saves end in the page cache while the
others' end on the disk), next to this machine's memcpy of the same bytes, in one run;
then unbroken's snapshot every step, both ways, and a control that saves nothing (what
the step time lost reads when there is nothing to find: this VM's noise, in this run).

    python bench/overlap.py                          # ~192 MiB of AdamW state per rank
    python bench/overlap.py --mib 16 --repeats 1     # smoke, about a minute

The job (bench/overlap_job.py): an MLP trained with AdamW, one thread per rank, its
forward and backward longer than its optimizer step. Each method runs `PERIODS` periods
of `EVERY` steps with a save at the start of each (of snapshots, one every step), the
save waited for at the period's end, each between two periods of as many steps without
(the step time lost: `lost`); staging
memory is allocated ahead where the library offers it; a method's staging is waited for
the way its documentation says before the next optimizer step (DCP:
``staging_completion``; torch-checkpointing: ``with manager.lock(): optimizer.step()``;
unbroken: nothing, its optimizer step pre-hook does it). It runs twice:

- a core to spare: one rank on one of the 2 cores, the other core free for the save's
  background work, as a GPU node's host has cores that training leaves idle: the step
  time lost here is what the save itself costs the loop;
- no core to spare: 2 data-parallel ranks (the same weights and batches, as after DDP's
  all-reduce: DCP and unbroken both write such a tensor once), one on each core, so the
  background write and checksums can only take cycles from training.

Each save of each run's first repeat is restored into a fresh model and compared, bit
for bit, with the values at the save. Reported for the slowest rank: the time ``save``
blocks the loop and the write rate to durable (from the call to the save's completion,
the training going on meanwhile), both from the 2-rank run against a memcpy by both
ranks at once; the step time lost in each run; and the host memory a method adds, from
bench/overlap_memory.py (one rank, a fresh process per method). Beside the step time
lost, which this VM's noise moves by several percent between periods, the time the
training thread waited for a core while it could run (Linux's schedstat), per save:
what a method's threads take from the loop when they outnumber the idle cores.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common import (
    MIB,
    free_port,
    hand_back,
    join_gloo,
    leave_group,
    max_over_ranks,
    new_table,
    print_result,
    read_back,
    rotated,
    run_ranks,
    show,
)
from overlap_job import (
    EVERY,
    LABELS,
    METHODS,
    PERIODS,
    Method,
    make_model,
    remove,
    train_step,
    values,
)
from overlap_memory import memory_worker

# DCP's process writer (which imports this file) logs every request at INFO on stderr
logging.disable(logging.INFO)


def run_method(name: str, root: Path, mib: int, check: bool) -> dict[str, float]:
    """`PERIODS` periods of `EVERY` steps with a save at the start of each (of snapshots,
    one at each step), every save waited for at the period's end, each between two
    periods of as many steps with none; the numbers."""
    model, optim = make_model(mib, 0)  # data-parallel replicas: the same on every rank
    method = Method(name, root, model, optim)
    for _ in range(2):  # AdamW's state exists; the first steps' one-off costs are paid
        train_step(model, optim, method.guard)
    method.prepare()
    every_step = name.startswith("snapshot")
    took: dict[bool, list[float]] = {False: [], True: []}  # saving? -> each period's time
    waited: dict[bool, list[float]] = {False: [], True: []}  # ... its wait for a core
    blocked, durable, step = [], [], 0
    saved: dict[int, list[torch.Tensor]] = {}
    for period in range(2 * PERIODS + 1):
        saving, excluded = period % 2 == 1, 0.0
        dist.barrier()
        start, queued = time.perf_counter(), run_queue_s()
        for k in range(EVERY):
            if saving and (every_step or k == 0):
                if check:  # off the clock; of snapshots, the newest is checked
                    cloned = time.perf_counter()
                    saved = {**({} if every_step else saved), step: values(model, optim)}
                    excluded += time.perf_counter() - cloned
                called = time.perf_counter()
                method.save(step)
                blocked.append(time.perf_counter() - called)
                if not every_step:  # a snapshot is never durable: no poller every step
                    finished = finish_time(method.done)
            train_step(model, optim, method.guard)
            step += 1
        if saving:
            method.pending()
            durable.append(0.0 if every_step else finished() - called)  # the last save's
        took[saving].append(time.perf_counter() - start - excluded)
        waited[saving].append(run_queue_s() - queued)
    wrong = sum(_wrong(method, n, want, mib) for n, want in saved.items())
    method.close()
    return {
        "block_s": max(blocked),
        "lost": lost(took[True], took[False]),
        "core_wait_s": core_wait(waited[True], waited[False]) / (EVERY if every_step else 1),
        "durable_s": statistics.median(durable),
        "wrong": wrong,
    }


def lost(saving: list[float], quiet: list[float]) -> float:
    """The step time lost: of each period with saves against the mean of the two without
    around it, the median (a period slowed by something else on the machine is left out,
    and drift between the start and the end of the run cancels)."""
    around = [(a + b) / 2 for a, b in itertools.pairwise(quiet)]
    return statistics.median(s / q for s, q in zip(saving, around, strict=True)) - 1


def run_queue_s() -> float:
    """How long this thread has waited for a core, runnable (Linux's schedstat)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def core_wait(saving: list[float], quiet: list[float]) -> float:
    """The training thread's wait for a core in a period with saves, over the mean of
    the two periods without around it: the median, in seconds. A save's threads that
    outnumber the cores training leaves idle take the loop's: measured here apart from
    the VM's noise, which moves the step time by several percent between periods."""
    around = [(a + b) / 2 for a, b in itertools.pairwise(quiet)]
    return statistics.median(s - q for s, q in zip(saving, around, strict=True))


def finish_time(done: Callable[[], bool]) -> Callable[[], float]:
    """When ``done()`` first became true, found by a thread that asks every 5 ms; the
    returned function waits for it."""
    at: list[float] = []

    def poll() -> None:
        while not done():
            time.sleep(0.005)
        at.append(time.perf_counter())

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()

    def finished() -> float:
        thread.join()
        return at[0]

    return finished


def _wrong(method: Method, step: int, want: list[torch.Tensor], mib: int) -> int:
    """How many tensors of the save of ``step`` differ from the values at the save."""
    model, optim = make_model(mib, seed=99)
    train_step(model, optim, lambda s: s())
    method.load(step, model, optim)
    return sum(not torch.equal(a, b) for a, b in zip(values(model, optim), want, strict=True))


def memcpy_s(mib: int) -> float:
    """This machine's limit: the state's bytes copied into memory already touched, by
    every rank at once (best of 3)."""
    model, optim = make_model(mib, dist.get_rank())
    train_step(model, optim, lambda s: s())
    tensors = values(model, optim)
    into = [torch.empty_like(t) for t in tensors]
    for dst, src in zip(into, tensors, strict=True):
        dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for dst, src in zip(into, tensors, strict=True):
            dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def worker(
    rank: int, world: int, port: int, root: str, mib: int, repeats: int, methods: list[str]
) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's process writer meets its peers there
    join_gloo(rank, world, port, timeout_s=300)
    out: dict[str, Any] = {"memcpy_s": [], "methods": {m: [] for m in methods}}
    for rep in range(repeats):
        out["memcpy_s"].append(max_over_ranks(memcpy_s(mib))[0])
        for name in rotated(methods, rep):
            where = Path(root) / f"{name}-{rep}"
            got = run_method(name, where, mib, check=rep == 0 and name != "control")
            worst = max_over_ranks(*got.values())
            out["methods"][name].append(dict(zip(got, worst, strict=True)))
            dist.barrier()
            if rank == 0:
                remove(where)
    out["nbytes"] = sum(t.nbytes for t in values(*_stepped(mib)))
    hand_back(root, out, f"ranks-{world}.json")
    leave_group()


def _stepped(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optim = make_model(mib, 0)
    train_step(model, optim, lambda s: s())
    return model, optim


def available() -> list[str]:
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError:
        print("torch-checkpointing is not installed (pip install torch-checkpointing): left out")
        return [m for m in METHODS if m != "torch_checkpointing"]
    return list(METHODS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=192, help="state per rank, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    methods = available()
    root = tempfile.mkdtemp(prefix="unbroken-overlap-")
    try:
        for world in (1, 2):
            args = (world, free_port(), root, opts.mib, opts.repeats, methods)
            run_ranks(worker, args, world)
        for name in methods:  # a fresh process each
            run_ranks(memory_worker, (free_port(), root, opts.mib, name), 1)
        runs = {world: read_back(root, f"ranks-{world}.json") for world in (1, 2)}
        memory = {name: read_back(root, f"memory-{name}.json") for name in methods}
        report(runs, memory, methods)
    finally:
        shutil.rmtree(root, ignore_errors=True)


PEERS = ("dcp_thread", "dcp_process", "torch_checkpointing")


def report(runs: dict[int, Any], memory: dict[str, Any], methods: list[str]) -> None:
    memcpy = {world: min(run["memcpy_s"]) for world, run in runs.items()}
    nbytes = runs[2]["nbytes"]
    table = new_table(
        f"Background saves of {nbytes / MIB:.0f} MiB of AdamW state per rank",
        f"medians over repeats of the slowest rank's slowest call; a save every {EVERY} "
        f"steps, or a snapshot every step; limit: memcpy, {memcpy[1] * 1e3:.1f} ms by one "
        f"rank, {memcpy[2] * 1e3:.1f} ms by both at once; a core to spare: 1 rank, the other "
        "core free; no core to spare: 2 ranks; to durable: 2 ranks; core wait: the training "
        "thread's wait for a core while runnable, per save, over the periods without saves",
        [("method", "left"),
         *(c for w in ("spare core", "no spare core")
           for c in ((f"{w}: blocks", "right"), ("of memcpy", "right"),
                     ("step time lost", "right"), ("core wait", "right"))),
         ("memory added", "right"), ("to durable", "right"), ("restored", "left")],
    )  # fmt: skip
    result: dict[str, Any] = {f"memcpy_ms_{w}_ranks": round(memcpy[w] * 1e3, 2) for w in runs}
    for name in methods:
        row, figures = [LABELS[name]], dict[str, float]()
        for world, config in ((1, "spare_core"), (2, "no_spare_core")):
            got = runs[world]["methods"][name]
            block = statistics.median(r["block_s"] for r in got)
            lost = statistics.median(r["lost"] for r in got)
            wait = statistics.median(r["core_wait_s"] for r in got)
            row += [f"{block * 1e3:.1f} ms", f"{100 * block / memcpy[world]:.0f} %",
                    f"{100 * lost:+.1f} %", f"{wait * 1e3:.1f} ms"]  # fmt: skip
            figures |= {f"block_ms_{config}": round(block * 1e3, 2),
                        f"block_of_memcpy_{config}": round(block / memcpy[world], 3),
                        f"lost_{config}": round(lost, 4),
                        f"core_wait_ms_{config}": round(wait * 1e3, 2)}  # fmt: skip
        durable = statistics.median(r["durable_s"] for r in runs[2]["methods"][name])
        added = memory[name]["extra"] / MIB
        wrong = int(sum(runs[w]["methods"][name][0]["wrong"] for w in runs))
        rate, written, restored = 0.0, "-", "-"  # the control saves nothing
        if name.startswith("snapshot"):  # nothing durable: shared memory
            written = "in memory"
        elif name != "control":
            rate = 2 * nbytes / 2**30 / durable
            written = f"{rate:.2f} GiB/s"
        if name != "control":
            restored = "bitwise" if not wrong else f"{wrong} tensor(s) differ"
        row += [f"{added:.0f} MiB", written, restored]
        table.add_row(*row)
        result[name] = figures | {
            "memory_mib": round(added, 1), "durable_gib_s": round(rate, 3), "wrong": wrong,
        }  # fmt: skip
    show(200, table)
    result["unbroken_at_or_beyond_peers"] = beyond(result, [p for p in PEERS if p in methods])
    print_result(result)


def beyond(result: dict[str, Any], peers: list[str]) -> dict[str, bool]:
    """For each figure, whether unbroken's overlapped save is at or beyond every peer's
    (less blocking, loss and memory; a faster write)."""
    ours = result["unbroken"]
    less = [
        f"{f}_{c}"
        for f in ("block_ms", "lost", "core_wait_ms")
        for c in ("spare_core", "no_spare_core")
    ]
    less.append("memory_mib")
    out = {key: all(ours[key] <= result[p][key] for p in peers) for key in less}
    out["durable_gib_s"] = all(ours["durable_gib_s"] >= result[p]["durable_gib_s"] for p in peers)
    return out


if __name__ == "__main__":
    main()
