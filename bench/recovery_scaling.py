"""How process-group (re-)initialisation grows with the number of ranks: the scaling part
of bench/recovery.py."""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any

from common import free_port
from recovery_scenarios import RecoveryConfig


def pg_rank(rank: int, world: int, port: int, repeats: int, results: Any) -> None:
    """One rank of the process-group measurement (a forked child: no interpreter start or
    imports to pay). Round 0 connects to the store first, as a restarted process must."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    connect = time.time()
    store = dist.TCPStore(
        "127.0.0.1", port, world_size=world, is_master=rank == 0, timeout=timeout,
        wait_for_workers=False,
    )  # fmt: skip
    rounds = []
    for i in range(repeats):
        started = time.time()
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"round-{i}", store), rank=rank, world_size=world,
            timeout=timeout,
        )  # fmt: skip
        dist.barrier()
        ready = time.time()
        group = dist.new_group(backend="gloo", timeout=timeout)  # what a Checkpointer does
        dist.barrier(group=group)
        rounds.append((started, ready, time.time()))
        dist.destroy_process_group()
    results.put((rank, connect, rounds))


def run_scaling(cfg: RecoveryConfig, ranks: int) -> dict[str, Any]:
    """Initialise the default gloo group, then a Checkpointer-style ``new_group``, in
    ``ranks`` processes, --scaling-repeats times on one store with a fresh key prefix per
    round (as a recovery that keeps its processes would). Each time is from the last rank
    to start to the last rank to finish."""
    ctx = mp.get_context("fork")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=pg_rank, args=(r, ranks, port, cfg.scaling_repeats, results))
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 120
    got: list[tuple[int, float, list[tuple[float, float, float]]]] = []
    while len(got) < ranks:
        if not results.empty():
            got.append(results.get())
        elif time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"process groups, {ranks} ranks: a rank failed or hung")
        else:
            time.sleep(0.01)
    for proc in procs:
        proc.join()
    connect = max(c for _, c, _ in got)
    rounds = list(zip(*(r for _, _, r in got), strict=True))  # per round: every rank's times
    init = [max(r[1] for r in rnd) - max(r[0] for r in rnd) for rnd in rounds]
    group = [max(r[2] for r in rnd) - max(r[1] for r in rnd) for rnd in rounds]
    return {
        "ranks": ranks,
        "first_init_s": round(max(r[1] for r in rounds[0]) - connect, 4),
        "reinit_median_s": round(statistics.median(init[1:]), 4),
        "reinit_s": [round(t, 4) for t in init[1:]],
        "new_group_median_s": round(statistics.median(group[1:]), 4),
    }


def growth(scaling: list[dict[str, Any]], key: str) -> float | None:
    """Exponent k of time ~ ranks^k, least squares on log-log."""
    points = [(math.log(s["ranks"]), math.log(s[key])) for s in scaling if s[key] > 0]
    if len(points) < 2:
        return None
    mx = statistics.mean(x for x, _ in points)
    my = statistics.mean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None
