"""Run a function on N real processes joined by a gloo process group, with a timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

# What every rank imports; safe to import before a fork (no threads start at import).
PRELOAD = ("torch", "torch.distributed", "unbroken", "unbroken.checkpointer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    args: tuple,
    queue: Any,
    env: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's, as now: not the fork server's, as when it started
    os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),  # also how long a rank waits for rank 0 to start
        )
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(fn: Callable[..., Any], args: tuple, world: int) -> tuple[list[Any], Any]:
    """``fn(rank, world, *args)`` started on ``world`` processes joined by gloo; the
    processes and the queue each puts ``(rank, "ok" or "error", value)`` on."""
    # Forked from one server that imported torch and the library once: a spawned rank
    # spent about 3 s importing them (a test's ranks share 2 cores), a forked one nothing.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    queue, port = ctx.Queue(), free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, args, queue, env), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs, queue


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    timeout: float = 90,
    exits: Collection[int] = (),
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; their results by rank.

    Raises AssertionError with the rank's traceback if any rank fails, and kills every
    rank if they have not all finished within ``timeout`` seconds. The ranks in
    ``exits`` are expected to end their process instead of returning (a test of a peer
    that dies): their result is None."""
    procs, queue = start_ranks(fn, args, world)
    results: dict[int, Any] = dict.fromkeys(exits)
    errors: list[str] = []
    try:
        for _ in range(world - len(results)):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    except Exception:
        errors.append(
            f"ranks {sorted(set(range(world)) - set(results))} timed out after {timeout}s"
        )
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world)]
