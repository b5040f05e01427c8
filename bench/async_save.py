"""Background saves: unbroken's ``save(blocking=False)`` against
``torch.distributed.checkpoint.async_save`` (thread and process modes), next to this machine's
limits measured in the same run, on the same state as bench/save_load.py.

    python bench/async_save.py                                  # 2 ranks x 512 MiB, 5 repeats
    python bench/async_save.py --mib-per-rank 32 --repeats 2    # smoke, well under a minute
    python bench/async_save.py --sdc-off    # without the replica check (this state has
                                            # no replicated part: bench/sdc_cost.py)

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

import logging
import shutil
import sys
from dataclasses import replace

import torch.multiprocessing as mp

from async_save_memory import MEMORY, memory_worker, result_file
from async_save_report import report
from async_save_run import worker
from common import (
    DiskConfig,
    disk_config,
    free_port,
    print_result,
    read_back,
    run_ranks,
)
from limits import check_limits

# DCP's process-mode daemon (which imports this file) logs every request at INFO on stderr
logging.disable(logging.INFO)


def main() -> None:
    # the cost of `unbroken.sdc`'s default comparison: this run against one with --sdc-off
    sdc_off = "--sdc-off" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--sdc-off"]
    cfg = disk_config(
        __doc__.split("\n\n")[0],
        repeats_help="the first call + steady state",
        min_repeats=2,
        prefix="unbroken-async-",
        copies=lambda repeats: 4,  # a few saves on disk at once, at most
    )
    workdir = cfg.dir
    try:
        run_ranks(worker, (cfg, sdc_off), cfg.ranks)
        raw = read_back(workdir)
        memory = measure_memory(cfg)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = report(cfg, raw, memory)
    print_result(result)
    # durable: speed over the fastest raw writer's; blocking: a copy cannot beat memcpy
    memcpy = result["limits"]["memcpy_ms"]
    blocking = {f"blocking {m}": memcpy / v["best"] for m, v in result["blocking_ms"].items()}
    check_limits(result["durable_of_write_limit"] | blocking, "bench/async_save.py")


def measure_memory(cfg: DiskConfig) -> dict[str, list[dict[str, object]]]:
    """Each method in ranks of its own. Peaks are per process, so both methods' fresh
    processes may run at once (their timings are not reported)."""
    ports: list[int] = []
    while len(ports) < len(MEMORY):
        if (port := free_port()) not in ports:
            ports.append(port)
    spawned = [
        mp.spawn(
            memory_worker,
            args=(replace(cfg, port=port), method),
            nprocs=cfg.ranks,
            join=False,
        )
        for method, port in zip(MEMORY, ports, strict=True)
    ]
    for context in spawned:
        while not context.join():
            pass
    return {m: read_back(cfg.dir, result_file(m)) for m in MEMORY}


if __name__ == "__main__":
    main()
