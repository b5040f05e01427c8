"""In-process recovery, the worker side: `in_process(train)` keeps a healthy rank's
process alive through a peer's failure.

    model, optim = ...                        # built once per process
    state = {"model": model, "optim": optim, "progress": unbroken.Progress(step=0)}

    def train() -> None:                      # one generation
        ckpt = unbroken.Checkpointer(path, memory=True, replicas=1)
        ckpt.restore(state)                   # own shared memory, a replica, or storage
        ddp = DistributedDataParallel(model)  # holds the generation's process group
        for step in ...: ...

    unbroken.run.in_process(train)

Under ``unbroken run --in-process`` (`unbroken.run.supervisor`) the supervisor hosts a
TCPStore that outlives every worker, with a *generation* counter in it. `in_process`
connects to it, reads generation g, initialises the default process group (gloo) on the
store prefix ``unbroken/gen-<g>`` and calls ``train()``. When a peer dies, the supervisor
sets ``unbroken/abort-<g>``; a watcher thread here waits on that key and aborts the
generation's process groups (`unbroken.job.abort`: their connections are shut down, so any
collective still waiting fails at once, here and on every peer, instead of at its
timeout). A rank that sees a collective fail on a vanished peer before any abort reports
it (``unbroken/suspect-<g>``): across nodes the coordinator then finds the lost node by
pinging the agents instead of waiting out its node timeout. The failure surfaces in
``train()``; `in_process` abandons the generation's
Checkpointers and groups, waits (bounded) for the supervisor to move the generation past
g, which it does once it has respawned the dead ranks under the same rank numbers, and
calls ``train()`` again in the same process. So the healthy ranks skip the interpreter
start, the imports and the model's construction, and roll back from their own memory;
only the replacements start fresh and pull their state from a peer's replica.

``train()`` must build everything that holds a process group in each call (DDP wrappers,
the Checkpointer, whose own gloo group belongs to the old default group); the model and
optimizer may live across calls, since restore rolls their values back.

Where in-process recovery cannot work (no supervisor store, the store is gone, the
generation does not move) `in_process` raises `InProcessError`, saying to run without
``--in-process``: plain `unbroken run` restarts every worker and still restores from
memory. Outside ``--in-process`` (under torchrun or plain `unbroken run`) `in_process` is
`unbroken.run.init_process_group` followed by one call of ``train()``.

Process-group initialisation through the store takes milliseconds (see
`unbroken.run.measure`), against ~2 s for a replacement process to start and import
torch, which the warm spares of ``--warm-spare`` (`unbroken.run.spare`) remove.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

from unbroken.errors import PeerLostError
from unbroken.job import abort
from unbroken.run import contract, listen, worker
from unbroken.run.news import announce
from unbroken.run.watcher import AbortWatcher

T = TypeVar("T")

# How long a healthy rank waits for a failed peer's replacement once the supervisor is
# recovering (it aborted the generation): a replacement pod or node can take minutes.
WAIT_S = 1200.0
# How long a rank whose collective failed waits for the supervisor to see a failure at
# all: past it, no peer died, and the error is the training code's own.
ACK_S = 60.0
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


def in_process(train: Callable[[], T], *, timeout_s: float = 60.0, wait_s: float = WAIT_S) -> T:
    """Call ``train()`` with the default process group initialised, and again, in this
    process, each time a peer fails and the supervisor replaces it.

    ``timeout_s`` bounds process-group initialisation and every collective; ``wait_s``
    how long a healthy rank waits for a failed peer's replacement (`_next_generation`)."""
    if os.environ.get(contract.IN_PROCESS_ENV) != "1":
        return _once(train, timeout_s)
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    # The coordinator as the user named it (a node agent's relay is only a local port).
    where = env.get(contract.COORDINATOR_ENV) or f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    try:
        store = _connect(timeout_s)
        generation = _generation(store)
        watcher = AbortWatcher(_connect(timeout_s))
    except Exception as e:
        raise InProcessError(
            f"cannot reach the supervisor's store at {where} ({e}); {FALLBACK}"
        ) from e
    watcher.start()
    # What exists now lives through every generation: frozen, the collection after a
    # failure (`_abandon`) scans only the failed generation's objects (ms, not ~0.6 s).
    gc.freeze()
    while True:
        _fence(store, generation, rank)
        worker.new_attempt(generation)  # events carry it; its first step is reported again
        worker.event("init_start", generation=generation)
        abort.begin(generation)
        watcher.watch(generation)
        try:
            with _beating():  # waiting for a replacement that is still starting is not hanging
                _join(generation, rank, world, timeout_s)
        except Exception as e:  # a rank of this generation died before it joined
            error = str(e)
            _report(store, generation, rank)
            worker.event("init_failed", generation=generation, error=error[:300])
            del e
            _abandon(generation)
            generation = _next_generation(store, generation, wait_s, error, where, watcher)
            continue
        prefix = f"{contract.GENERATION_PREFIX}{generation}"
        worker.event("init_done", generation=generation, prefix=prefix)
        try:
            result = train()
        except Exception as e:
            if not (watcher.fired(generation) or _peer_failure(e)):
                raise  # the training code's own error: not ours to retry
            error = str(e)
            if not watcher.fired(generation):
                _report(store, generation, rank)
            worker.event("peer_failure", generation=generation, error=error[:300])
            del e  # its traceback holds the failed generation's model and groups
            _abandon(generation)
            generation = _next_generation(store, generation, wait_s, error, where, watcher)
            continue
        watcher.watch(None)
        worker.event("train_done", generation=generation)  # no heartbeats from here on
        _teardown()
        return result


def _fence(store: Any, generation: int, rank: int) -> None:
    """Leave, before joining ``generation``, if this rank's node was declared lost: its
    agent no longer holds the node's slot (a node stopped, as a hung kernel or a cut
    network stops it, and woke up after the coordinator gave its ranks to a replacement).
    Joining would put two processes on one rank. ``generation`` was read before the
    slot: a generation that replaced this node was started after its slot was freed."""
    agent, node = os.environ.get(contract.AGENT_ENV), os.environ.get(contract.NODE_ENV)
    if not agent or not node:
        return  # one machine: the supervisor's own ranks
    key = contract.slot_key(int(node), "owner")
    try:
        holder = store.get(key).decode() if store.check([key]) else None
    except Exception:
        return  # the store is gone: joining finds out and says so
    if holder != agent:
        raise SystemExit(
            f"unbroken: rank {rank} leaves: its node {node} was declared lost (it was "
            f"silent too long) and the coordinator gave the node's ranks to another agent "
            f"for generation {generation}; this machine must not rejoin the job. If it "
            "was only slow, raise the coordinator's --ping-after or --answer-timeout"
        )


def _report(store: Any, generation: int, rank: int) -> None:
    """Tell the store that this rank saw a peer vanish in ``generation``: across nodes,
    the coordinator then finds a lost node by ping instead of waiting out its node
    timeout (`unbroken.run.coordinator`); the one-machine supervisor sees exits itself."""
    with contextlib.suppress(Exception):
        store.append(f"{contract.SUSPECT_KEY}-{generation}", f"{rank},")
        announce(store)


def _join(generation: int, rank: int, world: int, timeout_s: float) -> None:
    """Initialise the default group of ``generation`` on its own store prefix, with its
    sockets tracked so that an abort can shut them down.

    The rendezvous waits on a store connection of its own, tracked too: when the
    generation is aborted while ranks still wait for each other (another rank died
    meanwhile), the wait ends at once instead of at its timeout, which would keep this
    rank out of the next generation until the ranks waiting there had timed out."""
    import torch.distributed as dist

    from unbroken.job import comm

    with abort.tracking():
        store = _connect(timeout_s)
    abort.check(f"joining generation {generation}")  # aborted before the connection counted

    def create() -> Any:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"{contract.GENERATION_PREFIX}{generation}", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        return dist.group.WORLD

    comm.gloo_group(create)  # lazy: O(world) store requests, not the eager mesh's O(world²)


def _abandon(generation: int) -> None:
    """Give up the failed generation without waiting on any peer: shut its connections
    down (peers blocked on this rank fail at once instead of at their timeout), let the
    Checkpointers' background work end, and unregister the groups."""
    from torch.distributed import distributed_c10d

    abort.shutdown()
    busy = abort.abandon_all()  # never waited for: the next save settles them (`abort.settle`)
    if busy:
        worker.event("abandoned_saves", generation=generation, checkpointers=busy)
    # The failed groups are kept, never destroyed: destroying a gloo group whose worker
    # is still disposing of a failed operation deadlocks (the worker holds the group's
    # lock and waits for the GIL, which the destroying thread holds), and one with an
    # operation stuck until its timeout blocks. A kept group costs two idle threads.
    _keep_forever(list(distributed_c10d._world.pg_map))
    _teardown()
    # Groups are named by a per-process counter, and their rendezvous keys by the name.
    # A join that failed counted its group without registering it, so no teardown
    # resets the counter: this rank would name the next generation's groups "1", "2"...
    # while its replacements start from "0", and each side would wait for the other.
    distributed_c10d._world.group_count = 0
    gc.collect()  # the old generation's model, optimizer and DDP reducers, in cycles


def _keep_forever(objects: list[Any]) -> None:
    """Make sure ``objects`` are never deallocated, not even at interpreter exit."""
    import ctypes

    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _connect(timeout_s: float) -> Any:
    env = os.environ
    return listen.connect(env["MASTER_ADDR"], int(env["MASTER_PORT"]), min(timeout_s, 10.0))


def _once(train: Callable[[], T], timeout_s: float) -> T:
    import torch.distributed as dist

    if not dist.is_initialized():
        worker.init_process_group("gloo", timeout_s=timeout_s)
    try:
        return train()
    finally:
        _teardown()


def _generation(store: Any) -> int:
    return int(store.add(contract.GENERATION_KEY, 0))


def _next_generation(
    store: Any, generation: int, wait_s: float, error: str, where: str, watcher: AbortWatcher
) -> int:
    """The first generation after ``generation``, once the supervisor starts it: within
    `ACK_S` if it never aborted ``generation`` (it saw no failure), else within
    ``wait_s`` (it is waiting for a replacement), beating the heartbeat meanwhile. The
    watcher's connection waits for both announcements: no request to the store from here
    until the next generation started (thousands of waiting ranks polling it would be
    hundreds of thousands of requests a second)."""
    started = time.monotonic()
    while not watcher.started(generation + 1):
        if watcher.gone is not None:
            raise InProcessError(
                f"a peer failed ({error}) and the supervisor's store at {where} is gone "
                f"({watcher.gone}); {FALLBACK}"
            )
        _waiting()
        waited = time.monotonic() - started
        if not watcher.fired(generation) and waited > min(ACK_S, wait_s):
            raise InProcessError(
                f"a collective failed ({error}) but the supervisor saw no failure within "
                f"{min(ACK_S, wait_s):g} s: no peer died, so this is an error of the training "
                "code itself, or the supervisor is stuck"
            )
        if waited > wait_s:
            raise InProcessError(
                f"a peer failed ({error}) and no replacement joined within {wait_s:g} s: "
                "add standby capacity (--warm-spare, a standby node), or give "
                "in_process(wait_s=...) more time"
            )
        time.sleep(0.01)  # local: the watcher's flags
    try:
        return _generation(store)
    except Exception as e:
        raise InProcessError(
            f"a peer failed ({error}) and the supervisor's store at {where} is gone "
            f"({e}); {FALLBACK}"
        ) from None


@contextlib.contextmanager
def _beating() -> Iterator[None]:
    """`_waiting`'s heartbeats from a thread while the block runs (a rendezvous blocks in
    C++); the join's own timeout and the generation's abort still end it."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(worker.HEARTBEAT_INTERVAL_S):
            _waiting()

    beater = threading.Thread(target=beat, name="unbroken-joining", daemon=True)
    beater.start()
    try:
        yield
    finally:
        done.set()
        beater.join()


def _waiting() -> None:
    """A heartbeat of the last step while this rank waits for a failed peer's
    replacement: waiting is not hanging, and no watchdog may report or restart it."""
    context = worker.current()
    now = time.monotonic()
    if context.dir is not None and now - context.last_beat >= worker.HEARTBEAT_INTERVAL_S:
        context.beat(context.beat_step, now)


def _peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective failing on a lost peer."""
    import torch.distributed as dist

    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistError | PeerLostError):
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
