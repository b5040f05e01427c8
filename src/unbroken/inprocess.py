"""In-process recovery, the worker side: `run(train)` keeps a healthy rank's process alive
through a peer's failure.

    model, optim = ...                        # built once per process
    state = {"model": model, "optim": optim, "progress": unbroken.Progress(step=0)}

    def train() -> None:                      # one generation
        ckpt = unbroken.Checkpointer(path, memory=True, replicas=1)
        ckpt.restore(state)                   # own shared memory, a replica, or storage
        ddp = DistributedDataParallel(model)  # holds the generation's process group
        for step in ...: ...

    unbroken.inprocess.run(train)

Under ``unbroken run --in-process`` (`unbroken.supervisor`) the supervisor hosts a
TCPStore that outlives every worker, with a *generation* counter in it. `run` connects to
it, reads generation g, initialises the default process group (gloo) on the store prefix
``unbroken/gen-<g>`` and calls ``train()``. When a peer dies, the supervisor sets
``unbroken/abort-<g>``; a watcher thread here waits on that key and aborts the
generation's process groups (`unbroken.abort`: their connections are shut down, so any
collective still waiting fails at once, here and on every peer, instead of at its
timeout). The failure surfaces in ``train()``; `run` abandons the generation's
Checkpointers and groups, waits (bounded) for the supervisor to move the generation past
g, which it does once it has respawned the dead ranks under the same rank numbers, and
calls ``train()`` again in the same process. So the healthy ranks skip the interpreter
start, the imports and the model's construction, and roll back from their own memory;
only the replacements start fresh and pull their state from a peer's replica.

``train()`` must build everything that holds a process group in each call (DDP wrappers,
the Checkpointer, whose own gloo group belongs to the old default group); the model and
optimizer may live across calls, since restore rolls their values back.

Where in-process recovery cannot work (no supervisor store, the store is gone, the
generation does not move) `run` raises `InProcessError`, saying to run without
``--in-process``: plain `unbroken run` restarts every worker and still restores from
memory. Outside ``--in-process`` (under torchrun or plain `unbroken run`) `run` is
`unbroken.faults.init_process_group` followed by one call of ``train()``.

Process-group initialisation through the store (gloo, one process per rank, tiny ranks on
this 2-core machine, ``python -m unbroken.inprocess --measure 2 4 8``, median of 5
generations until every rank passed a barrier): 2.4 ms for 2 ranks, 4.8 ms for 4, 14.7 ms
for 8. gloo builds a full mesh through the one store: each rank reads every other rank's
address, so the store serves O(world²) requests and each rank makes O(world) round-trips;
beyond 4 ranks the 2 cores are oversubscribed too, so 8 ranks cost more than linear here.
Either way initialisation is milliseconds, against ~2 s for a replacement process to
start and import torch, which the warm spares of ``--warm-spare`` remove.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from unbroken import abort, faults

T = TypeVar("T")

IN_PROCESS_ENV = "UNBROKEN_IN_PROCESS"  # "1" when the supervisor started this process
GENERATION_KEY = "unbroken/generation"
ABORT_KEY = "unbroken/abort"  # -<g>: set by the supervisor when generation g failed
WAIT_S = 60.0  # how long a rank waits for the supervisor to start a new generation
FALLBACK = "run the job without --in-process: `unbroken run` restarts every worker instead"
# What a collective raises when a peer's process is gone (its sockets closed).
_PEER_GONE = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "gloo",
    "socket",
    "timed out",
    "timeout",
    "peer",
)


class InProcessError(RuntimeError):
    """In-process recovery cannot go on; the message says why and what to do instead."""


def run(train: Callable[[], T], *, timeout_s: float = 60.0, wait_s: float = WAIT_S) -> T:
    """Call ``train()`` with the default process group initialised, and again, in this
    process, each time a peer fails and the supervisor replaces it.

    ``timeout_s`` bounds process-group initialisation and every collective; ``wait_s``
    how long to wait for the supervisor to start a new generation after a failure."""
    if os.environ.get(IN_PROCESS_ENV) != "1":
        return _once(train, timeout_s)
    import torch.distributed as dist

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    where = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    timeout = timedelta(seconds=timeout_s)
    try:
        store = _connect(timeout_s)
        generation = _generation(store)
        watcher = _Watcher(_connect(timeout_s))
    except Exception as e:
        raise InProcessError(
            f"cannot reach the supervisor's store at {where} ({e}); {FALLBACK}"
        ) from e
    watcher.start()
    while True:
        # Events and heartbeats carry the generation as the attempt; the first step of
        # each generation is reported again.
        faults.new_attempt(generation)
        faults.event("init_start", generation=generation)
        abort.begin(generation)
        watcher.watch(generation)
        try:
            with abort.tracking():
                dist.init_process_group(
                    "gloo",
                    store=dist.PrefixStore(f"unbroken/gen-{generation}", store),
                    rank=rank,
                    world_size=world,
                    timeout=timeout,
                )
        except Exception as e:  # a rank of this generation died before it joined
            error = str(e)
            faults.event("init_failed", generation=generation, error=error[:300])
            del e
            _abandon(generation)
            generation = _next_generation(store, generation, wait_s, error, where)
            continue
        faults.event("init_done", generation=generation, prefix=f"unbroken/gen-{generation}")
        try:
            result = train()
        except Exception as e:
            if not (watcher.fired(generation) or _peer_failure(e)):
                raise  # the training code's own error: not ours to retry
            error = str(e)
            faults.event("peer_failure", generation=generation, error=error[:300])
            del e  # its traceback holds the failed generation's model and groups
            _abandon(generation)
            generation = _next_generation(store, generation, wait_s, error, where)
            continue
        watcher.watch(None)
        faults.event("train_done", generation=generation)  # no heartbeats from here on
        _teardown()
        return result


class _Watcher(threading.Thread):
    """Waits for the supervisor to give up on the running generation (it sets
    ``unbroken/abort-<g>`` as it replaces a failed rank), then aborts this process's
    groups, so that no collective of the old generation waits for its timeout."""

    def __init__(self, store: Any) -> None:
        super().__init__(name="unbroken-watcher", daemon=True)
        self.store = store
        self.generation: int | None = None
        self.done: int | None = None  # the generation aborted last

    def watch(self, generation: int | None) -> None:
        self.generation = generation

    def fired(self, generation: int) -> bool:
        return self.done == generation

    def run(self) -> None:
        while True:
            g = self.generation
            if g is None or g == self.done:
                time.sleep(0.01)
                continue
            try:
                # Generation g ends only by this key (the supervisor sets it before it
                # starts the next one), or by training ending, when nobody cares.
                self.store.wait([f"{ABORT_KEY}-{g}"], timedelta(days=1))
            except Exception:  # the store is gone: there is no recovery to watch for
                return
            self.done = g
            faults.event("abort", generation=g, connections=abort.shutdown(g))


def _abandon(generation: int) -> None:
    """Give up the failed generation without waiting on any peer: shut its connections
    down (peers blocked on this rank fail at once instead of at their timeout), let the
    Checkpointers' background work end, and unregister the groups."""
    import gc

    from torch.distributed import distributed_c10d

    from unbroken.checkpointer import abandon_all

    abort.shutdown()
    busy = abandon_all(timeout=2.0)
    if busy:
        faults.event("abandon_slow", generation=generation, checkpointers=busy)
    # The failed groups are kept, never destroyed: destroying a gloo group whose worker
    # is still disposing of a failed operation deadlocks (the worker holds the group's
    # lock and waits for the GIL, which the destroying thread holds), and one with an
    # operation stuck until its timeout blocks. A kept group costs two idle threads.
    _keep_forever(list(distributed_c10d._world.pg_map))
    _teardown()
    gc.collect()  # the old generation's model, optimizer and DDP reducers, in cycles


def _keep_forever(objects: list[Any]) -> None:
    """Make sure ``objects`` are never deallocated, not even at interpreter exit."""
    import ctypes

    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _connect(timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=min(timeout_s, 10.0)),
        wait_for_workers=False,
    )


def _once(train: Callable[[], T], timeout_s: float) -> T:
    import torch.distributed as dist

    if not dist.is_initialized():
        faults.init_process_group("gloo", timeout_s=timeout_s)
    try:
        return train()
    finally:
        _teardown()


def _generation(store: Any) -> int:
    return int(store.add(GENERATION_KEY, 0))


def _next_generation(store: Any, generation: int, wait_s: float, error: str, where: str) -> int:
    """The first generation after ``generation``, once the supervisor starts it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            now = _generation(store)
        except Exception as e:
            raise InProcessError(
                f"a peer failed ({error}) and the supervisor's store at {where} is gone "
                f"({e}); {FALLBACK}"
            ) from None
        if now > generation:
            return now
        if time.monotonic() > deadline:
            raise InProcessError(
                f"a collective failed ({error}) but the supervisor started no new "
                f"generation within {wait_s:g} s: no peer died, so this is an error of the "
                "training code itself, or the supervisor is stuck"
            )
        time.sleep(0.01)


def _peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective failing on a lost peer."""
    import torch.distributed as dist

    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistError):
            return True
        if isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _PEER_GONE):
            return True
        # The Checkpointer reports another rank's failure of a collective step this way.
        if "failed on another rank" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# -- warm spares ------------------------------------------------------------------------


def spare(key: str) -> None:
    """A warm spare (``python -m unbroken.inprocess --spare KEY``): import torch and the
    library, say so under ``KEY/ready``, wait for an assignment under ``KEY/assign``
    (JSON: ``env`` and ``argv``), then become that worker by running its script here."""
    # The point: imported before they are needed (DDP, FSDP and compile import
    # torch._dynamo on first use: ~1 s here).
    import torch._dynamo  # noqa: F401
    import torch.distributed as dist

    import unbroken  # noqa: F401

    env = os.environ
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=30),
        wait_for_workers=False,
    )
    store.set(f"{key}/ready", str(os.getpid()))
    parent = os.getppid()
    while not store.check([f"{key}/assign"]):
        if os.getppid() != parent:
            sys.exit(0)  # the supervisor is gone
        time.sleep(0.005)
    job = json.loads(store.get(f"{key}/assign"))
    os.environ.update(job["env"])
    faults._reset()
    del store
    sys.argv = list(job["argv"])
    if job.get("module"):
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")


# -- measuring process-group initialisation ---------------------------------------------


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

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    result = {}
    for world in worlds:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
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
    if sys.argv[1:2] == ["--spare"]:
        spare(sys.argv[2])
    elif sys.argv[1:2] == ["--measure"]:
        for world, seconds in measure([int(a) for a in sys.argv[2:]] or [2, 4, 8]).items():
            print(f"{world} ranks: {seconds * 1000:.1f} ms")
    else:
        sys.exit("usage: python -m unbroken.inprocess --measure [N ...] | --spare KEY")
