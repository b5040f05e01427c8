"""How long process-group initialisation takes under in-process recovery:
``python -m unbroken.run.measure [N ...]``.

Measured here (gloo, one process per rank, tiny ranks on this 2-core machine,
``python -m unbroken.run.measure 2 4 8``, median of 5 generations until every rank passed
a barrier): 2.4 ms for 2 ranks, 4.8 ms for 4, 14.7 ms for 8. gloo builds a full mesh
through the one store: each rank reads every other rank's address, so the store serves
O(world²) requests and each rank makes O(world) round-trips; beyond 4 ranks the 2 cores
are oversubscribed too, so 8 ranks cost more than linear here. Either way initialisation
is milliseconds, against ~2 s for a replacement process to start and import torch, which
the warm spares of ``--warm-spare`` remove.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

from unbroken.run import listen


def _measure_rank(port: int, rank: int, world: int, rounds: int, out: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    times = []
    for g in range(rounds):
        store.add(f"bench/arrived-{g}", 1)  # start every rank together
        while int(store.add(f"bench/arrived-{g}", 0)) < world:
            time.sleep(0.001)
        t0 = time.perf_counter()
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"bench/gen-{g}", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        dist.barrier()
        times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
    out.put(times)


def measure(worlds: list[int], rounds: int = 5) -> dict[int, float]:
    """Median seconds for all ranks to initialise a gloo process group through one
    TCPStore and pass a barrier, per world size (one process per rank)."""
    import multiprocessing as mp
    import statistics

    ctx = mp.get_context("spawn")
    result = {}
    for world in worlds:
        store = listen.store()  # loopback only, as every store of unbroken's
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_measure_rank, args=(store.port, r, world, rounds, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        per_rank = [queue.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
        result[world] = statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
    return result


if __name__ == "__main__":
    for world, seconds in measure([int(a) for a in sys.argv[1:]] or [2, 4, 8]).items():
        print(f"{world} ranks: {seconds * 1000:.1f} ms")
