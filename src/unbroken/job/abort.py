"""Aborting gloo process groups whose collectives are stuck on a failed peer.

gloo has no abort that wakes an operation in flight: ``ProcessGroup.abort()`` and
``destroy_process_group()`` return, but a rank blocked in a receive from a live peer that
is itself stuck stays blocked until the group's timeout (minutes), and destroying a group
with such an operation waits for it. What does wake it is its connection going away, so
this module keeps the sockets of the process groups unbroken creates (the default group
of `unbroken.run.in_process` and each Checkpointer's group), and `shutdown` shuts down their
connections: every operation in flight on them fails at once with "connection closed",
here and on the peer at the other end, which then fails too instead of waiting.

Not quite every one: gloo can miss waking a send whose connection broke mid-transfer,
and a connection still being made as the generation is aborted is not there to shut
down; either then waits for the group's timeout. So the Checkpointer never blocks its
caller on its own gloo work without a bound: its waits poll `check` (its collectives and
transfers too: `unbroken.job.transfers`), and an aborted Checkpointer is
abandoned (`Checkpointer._abandon`, through `register` and `abandon_all`), not joined:
a recovery never waits for a save of the failed generation. A save still running then
can only fail (its group is aborted), but it may still be writing the files of its step,
which the next generation may save again; so the next save waits for it first
(`settle`), off the recovery's path. A save's work is bound to the generation it was
submitted in (`bound`): once a later generation begins, which clears the abort, work
left from an earlier one still fails at its next `check` instead of waiting on peers
that moved on, or, in `settle`, on itself.

NCCL groups (GPU) are aborted through torch's own abort
(``torch.distributed.distributed_c10d._abort_process_group``), which aborts every NCCL
communicator of the process inside one ncclGroupStart/End, so that no collective in
flight on a GPU waits for a dead peer (`abort_nccl`, called by `shutdown`). Set
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` for in-process recovery on GPUs, as torch asks:
otherwise NCCL's watchdog may tear the process down before the abort. On CPU (no NCCL
group) this part does nothing.

The groups connect lazily (`unbroken.job.comm.gloo_group`): a pair of ranks connects on
its first exchange, from one of gloo's threads, at any moment of the generation. So a
connection is recognised by its ends, not by when it was made: each rank's gloo device
listens on an address of its own, made while the group is built (`tracking` records it),
and the group's ranks share those addresses once (`adopt`). Every pair's connection has
a listener's address at one end: this rank's, where a peer connected to it, or a
peer's, where this rank connected, which is the end that matters when that peer is a
stopped machine that will never shut its own end down. Connections made while a group
is built (and the generation's store connection) are recognised by their inode too.
Listening sockets are left alone: gloo's listener thread aborts the process if its
socket is shut down under it. Groups the training code creates itself are not tracked;
their operations fail once a peer's do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Protocol, TypeVar

from unbroken.errors import PeerLostError

log = logging.getLogger("unbroken")
T = TypeVar("T")

POLL_S = 0.05  # how often waits of the Checkpointer look for an abort
SETTLE_S = 60.0  # the longest a save waits for an abandoned save (then goes on, warned)

_lock = threading.Lock()
_owned: set[str] = set()  # "socket:[inode]" links of tracked connections
_listeners: set[tuple[str, int]] = set()  # gloo listeners of this generation's groups
_enabled = False
_generation = 0
_aborted = threading.Event()
_bound = threading.local()  # .generation: that of the work this thread runs (`bound`)


class Abandonable(Protocol):
    """Something with background work on a process group that an abort may leave stuck
    (a Checkpointer): it can be given up on without being joined."""

    def _abandon(self) -> list[futures.Future[Any]]:
        """Stop at once without waiting on any peer; the work still running."""
        ...


_registered: weakref.WeakSet[Abandonable] = weakref.WeakSet()
_leftover: list[futures.Future[Any]] = []  # abandoned work that was still running


def register(obj: Abandonable) -> None:
    """Have `abandon_all` abandon ``obj`` while it lives (held weakly); its repr names
    it in `abandon_all`'s answer."""
    _registered.add(obj)


def abandon_all() -> list[str]:
    """Abandon every registered object of this process (in-process recovery, after its
    groups were aborted), waiting for none; the reprs of those whose work still runs."""
    busy = []
    for obj in list(_registered):
        if running := obj._abandon():
            busy.append(repr(obj))
            with _lock:
                _leftover.extend(running)
    return busy


def settle(what: str, timeout: float = SETTLE_S) -> None:
    """Before ``what`` writes: wait for the abandoned work of an earlier generation to
    end (it may be writing the files of the step about to be saved again). Returns at
    once when there is none, which is nearly always: a failed save ends as soon as its
    aborted group fails it. Work that is itself abandoned raises (`check`) rather than
    wait: it is among what it would wait for (bench/storm.py: a save queued behind a
    transfer to a hung peer started just after the abort, and the next generation's
    saves waited `SETTLE_S` behind it, their peers with them)."""
    with _lock:
        _leftover[:] = [f for f in _leftover if not f.done()]
        running = list(_leftover)
    deadline = time.monotonic() + timeout
    check(what)
    while futures.wait(running, POLL_S).not_done:
        check(what)
        if time.monotonic() > deadline:
            log.warning(
                "%s: a save abandoned by an earlier recovery is still running after %.0f s; "
                "going on (its files are only ever an uncommitted step's)", what, timeout,
            )  # fmt: skip
            return


def begin(generation: int = 0) -> None:
    """Generation ``generation`` of in-process recovery starts: track the sockets of
    process groups created from now on; nothing is aborted yet."""
    global _enabled, _generation
    with _lock:
        _enabled, _generation = True, generation
        _aborted.clear()
        _listeners.clear()  # the failed generation's groups: kept, never used again


def generation() -> int:
    """The generation running now (0 outside in-process recovery)."""
    return _generation


@contextlib.contextmanager
def bound(generation: int) -> Iterator[None]:
    """This thread runs work of ``generation`` meanwhile: `check` raises once that
    generation is aborted, and still once a later one has begun."""
    _bound.generation = generation
    try:
        yield
    finally:
        _bound.generation = None


def poll_s() -> float | None:
    """How long a wait that must notice an abort may block at a time: forever unless
    in-process recovery is on."""
    return POLL_S if _enabled else None


def check(what: str) -> None:
    """Raise if this generation was aborted (a peer failed). Waits on gloo work call
    this between bounded waits: gloo can miss waking an operation whose peer died."""
    mine = getattr(_bound, "generation", None)
    if _aborted.is_set() or (mine is not None and mine != _generation):
        raise PeerLostError(
            f"{what}: stopped because a peer failed; in-process recovery restarts training"
        )


def waited(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, collective work on connections `shutdown` cannot know yet (those it
    makes as it runs), on a helper thread, waited for in bounded waits that raise once
    the generation is aborted: a rank aborted as it joins a group never waits out the
    group's timeout for peers that have left for the next generation. The helper left
    behind ends its wait at that timeout. Outside in-process recovery: ``fn()``, here."""
    if not _enabled:
        return fn()
    check(what)
    done: futures.Future[T] = futures.Future()
    _helper().put((fn, done))
    while True:
        try:
            return done.result(timeout=POLL_S)
        except futures.TimeoutError:
            check(what)


# `waited`'s threads, each kept for the next wait once its function returned: starting a
# thread per wait cost a rank 2.5 % of its CPU at two waits a step (bench/storm.py).
_idle: list[queue.SimpleQueue[Any]] = []


def _helper() -> queue.SimpleQueue[Any]:
    """The inbox of an idle helper thread, started if none is idle (the others may be
    left in a wait on a failed peer, until gloo's timeout ends it)."""
    with _lock:
        if _idle:
            return _idle.pop()
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    threading.Thread(target=_serve, args=(inbox,), name="unbroken-waiting", daemon=True).start()
    return inbox


def _serve(inbox: queue.SimpleQueue[Any]) -> None:
    while True:
        fn, done = inbox.get()
        try:
            result, error = fn(), None
        except BaseException as e:
            result, error = None, e
        with _lock:  # idle before the waiter hears: its next wait finds this thread
            _idle.append(inbox)
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)
        del fn, done, result, error  # a helper keeps nothing of a wait


def _forget_helpers() -> None:
    """A forked child has none of its parent's threads."""
    _idle.clear()


os.register_at_fork(after_in_child=_forget_helpers)


@contextlib.contextmanager
def tracking() -> Iterator[list[tuple[str, int]]]:
    """Record the sockets created inside the block as belonging to a process group; the
    list given fills with the addresses of the listening ones (one per gloo device), for
    `adopt`. Nothing is recorded, and the list stays empty, outside in-process recovery."""
    made: list[tuple[str, int]] = []
    if not _enabled:
        yield made
        return
    before = set(_sockets().values())
    yield made
    with _lock:
        for fd, link in _sockets().items():
            if link not in before:
                _owned.add(link)
                with contextlib.suppress(OSError), _dup(fd) as sock:
                    if _tcp(sock) and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        made.append(_address(sock.getsockname()))


def adopt(listeners: list[tuple[str, int]]) -> None:
    """The gloo listeners of every rank of a group created under `tracking`: connections
    with one of them at either end belong to the group, whenever gloo makes them."""
    with _lock:
        if _enabled:
            _listeners.update((host, port) for host, port in listeners)


def shutdown(generation: int | None = None) -> int:
    """Abort the current generation (or only ``generation``, if it is still the current
    one): shut down every tracked connection (how many there were) and make `check`
    raise. Safe from any thread."""
    with _lock:
        if generation is not None and generation != _generation:
            return 0  # too late: that generation is over, its connections gone
        _aborted.set()
        owned = set(_owned)
        _owned.clear()  # the listeners stay known until the next generation begins:
        # a pair may still connect to one of them (a peer not yet aborted)
        count = sum(_shut(fd, link in owned) for fd, link in _sockets().items())
        count += abort_nccl()
    return count


def _shut(fd: int, owned: bool) -> bool:
    """Shut the connection on ``fd`` down if it is a tracked group's; whether it was."""
    with contextlib.suppress(OSError), _dup(fd) as sock:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        if owned or _pair(sock):
            sock.shutdown(socket.SHUT_RDWR)
            return True
    return False


def _pair(sock: socket.socket) -> bool:
    """Whether ``sock`` connects to, or was accepted by, a tracked group's listener."""
    if not _listeners or not _tcp(sock):
        return False
    ends = (_address(sock.getsockname()), _address(sock.getpeername()))
    return any(end in _listeners for end in ends)


def _tcp(sock: socket.socket) -> bool:
    return sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6)


def _address(name: Any) -> tuple[str, int]:
    """(host, port) of a socket address, IPv4 or IPv6."""
    return str(name[0]), int(name[1])


@contextlib.contextmanager
def _dup(fd: int) -> Iterator[socket.socket]:
    """A duplicate descriptor of ``fd`` as a socket: shutdown acts on the socket itself,
    and closing the duplicate leaves the owner's descriptor open (gloo closes its own)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        yield sock
    finally:
        sock.close()


def abort_nccl() -> int:
    """Abort this process's NCCL process groups with torch's own abort; how many there
    were (0 without torch.distributed loaded, or without NCCL groups: on CPU)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_nccl_available():
        return 0
    c10d = dist.distributed_c10d
    groups = [pg for pg, (backend, _) in list(c10d._world.pg_map.items()) if "nccl" in str(backend)]
    if not groups:
        return 0
    try:
        # WORLD: every group at once, inside one ncclGroupStart/End (aborting NCCL
        # communicators one by one can deadlock, pytorch issue 119797).
        c10d._abort_process_group(None)
    except (RuntimeError, ValueError):
        return 0  # destroyed meanwhile: nothing left to abort
    return len(groups)


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> "socket:[inode]"."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                found[int(name)] = link
    return found
