"""How process-group (re-)initialisation grows with the number of ranks: the scaling part
of bench/recovery.py, and on its own:

    python bench/recovery_scaling.py --ranks 2,4,8,16 --repeats 5

Per world size, in forked tiny ranks on one store: the default gloo group's
(re-)initialisation, a Checkpointer-style group created eagerly (gloo's full mesh, as
before) and lazily (``TORCH_GLOO_LAZY_INIT``, what `unbroken.job.comm.Comm` does outside
in-process recovery) with its first use (an all_gather, a broadcast and a ring of
point-to-point messages, what a Checkpointer does first), and in one extra round the
store requests each of them makes (a counting store wrapper: Python calls, so that
round is not timed). Ends with ``RESULT {json}``; docs/scaling.md projects it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from common import free_port
from recovery_scenarios import RecoveryConfig

LAZY = "TORCH_GLOO_LAZY_INIT"
REQUESTS = ("default_group", "eager_group", "lazy_group", "lazy_first_use")


def pg_rank(rank: int, world: int, port: int, repeats: int, results: Any) -> None:
    """One rank of the process-group measurement (a forked child: no interpreter start or
    imports to pay). Round 0 connects to the store first, as a restarted process must;
    the extra last round counts store requests instead of timing."""
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
    for i in range(repeats + 1):
        counting = _counting(dist.PrefixStore(f"round-{i}", store)) if i == repeats else None
        started = time.time()
        dist.init_process_group(
            "gloo", store=counting or dist.PrefixStore(f"round-{i}", store), rank=rank,
            world_size=world, timeout=timeout,
        )  # fmt: skip
        dist.barrier()
        times = [started, time.time()]
        counts = [counting.n if counting else 0]
        group = dist.new_group(backend="gloo", timeout=timeout)  # what a Checkpointer did
        dist.barrier(group=group)
        times.append(time.time())
        counts.append(counting.n if counting else 0)
        os.environ[LAZY] = "1"
        lazy = dist.new_group(backend="gloo", timeout=timeout)  # what it does now
        del os.environ[LAZY]
        times.append(time.time())
        counts.append(counting.n if counting else 0)
        _first_use(lazy, rank, world)
        times.append(time.time())
        counts.append(counting.n if counting else 0)
        dist.destroy_process_group()
        if counting is None:
            rounds.append(tuple(times))
        else:
            counted = [b - a for a, b in itertools.pairwise(counts)]
    results.put((rank, connect, rounds, [counts[0], *counted]))


def _first_use(group: Any, rank: int, world: int) -> None:
    """A Checkpointer's first collectives and replica traffic on its group."""
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(out, torch.ones(1), group=group)
    dist.broadcast(torch.zeros(1), group=group, group_src=0)
    peer, source = (rank + 1) % world, (rank - 1) % world
    ops = [
        dist.P2POp(dist.isend, torch.ones(4), group=group, group_peer=peer),
        dist.P2POp(dist.irecv, torch.zeros(4), group=group, group_peer=source),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _counting(inner: Any) -> Any:
    """A store that counts the requests made through it (per rank)."""
    import torch.distributed as dist

    class Counting(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def _count(self, n: int = 1) -> Any:
            self.n += n
            return inner

        def set(self, key: str, value: Any) -> None:
            self._count().set(key, value)

        def get(self, key: str) -> bytes:
            return bytes(self._count().get(key))

        def add(self, key: str, value: int) -> int:
            return int(self._count().add(key, value))

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            inner_ = self._count()
            inner_.wait(keys) if timeout is None else inner_.wait(keys, timeout)

        def check(self, keys: list[str]) -> bool:
            return bool(self._count().check(keys))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return bytes(self._count().compare_set(key, expected, desired))

        def delete_key(self, key: str) -> bool:
            return bool(self._count().delete_key(key))

        def num_keys(self) -> int:
            return int(inner.num_keys())

        def set_timeout(self, timeout: Any) -> None:
            inner.set_timeout(timeout)

        def has_extended_api(self) -> bool:
            return False

    return Counting()


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
    got: list[tuple[int, float, list[tuple[float, ...]], list[int]]] = []
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
    connect = max(c for _, c, _, _ in got)
    rounds = list(zip(*(r for _, _, r, _ in got), strict=True))  # per round: every rank's
    requests = [sum(c[i] for _, _, _, c in got) for i in range(4)]

    def span(a: int, b: int) -> list[float]:
        return [max(r[b] for r in rnd) - max(r[a] for r in rnd) for rnd in rounds]

    init, group, lazy, first = span(0, 1), span(1, 2), span(2, 3), span(3, 4)
    return {
        "ranks": ranks,
        "first_init_s": round(max(r[1] for r in rounds[0]) - connect, 4),
        "reinit_median_s": round(statistics.median(init[1:]), 4),
        "reinit_s": [round(t, 4) for t in init[1:]],
        "new_group_median_s": round(statistics.median(group[1:]), 4),
        "lazy_group_median_s": round(statistics.median(lazy[1:]), 4),
        "lazy_first_use_median_s": round(statistics.median(first[1:]), 4),
        "store_requests": dict(zip(REQUESTS, requests, strict=True)),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = SimpleNamespace(scaling_repeats=max(2, args.repeats))
    scaling = [run_scaling(cfg, int(n)) for n in args.ranks.split(",")]  # type: ignore[arg-type]
    exponents = {
        key: growth(scaling, key)
        for key in ("reinit_median_s", "new_group_median_s", "lazy_group_median_s")
    }
    for s in scaling:
        print(f"{s['ranks']:>4} ranks: init {s['reinit_median_s'] * 1e3:7.1f} ms, eager group "
              f"{s['new_group_median_s'] * 1e3:7.1f} ms, lazy group "
              f"{s['lazy_group_median_s'] * 1e3:6.1f} ms + first use "
              f"{s['lazy_first_use_median_s'] * 1e3:6.1f} ms; store requests "
              f"{s['store_requests']}")  # fmt: skip
    print("RESULT " + json.dumps({"scaling": scaling, "exponents": exponents}))


if __name__ == "__main__":
    main()
