"""The checkpointer's view of the job: its rank, the world size, and JSON collectives.

Checkpoint coordination runs on a process group of its own (gloo, host memory), so it
never interleaves with the training loop's collectives, whatever backend those use.
Messages are JSON, not pickles: nothing received from another process executes code.

The group connects lazily (gloo's ``TORCH_GLOO_LAZY_INIT``, `gloo_group`): a pair of
ranks connects when it first exchanges data. An eager gloo group connects the full mesh
at creation, every rank reading every other's address from the store: O(world²) store
requests, ~20 M at 2,304 ranks. The checkpointer's group needs only its collectives'
neighbours (rings, trees) and its replica partners: O(world) requests in all
(docs/scaling.md). Under in-process recovery the ranks then share their gloo listeners'
addresses once, so that `unbroken.job.abort` knows every connection the group will
ever make, and can shut it down to wake a collective stuck on a failed peer.

Once a collective or transfer fails because a peer is gone, the group is not used again
(`Comm.wire`): a rank that issues its next collective while a peer is still inside an
earlier one can pair two different operations, and gloo ends the process (std::terminate
on "Received data size doesn't match expected size") instead of raising. Point-to-point
transfers, and the rule that no gloo thread runs Python: `unbroken.job.transfers`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from unbroken.errors import CheckpointError, PeerLostError
from unbroken.job import abort
from unbroken.job.gc_paused import building
from unbroken.job.transfers import Transfers, done, lent

T = TypeVar("T")
R = TypeVar("R")

# How gloo and torch's store say that the other end of a connection is gone.
_GONE = ("connection closed", "connection reset", "broken pipe", "read error", "write error")
_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\]\s*")  # gloo's "[.../pair.cc:537] "
CLOSE_WAIT_S = 10.0  # ranks closing together arrive within this; past it a peer is not


class Comm:
    lost: str | None = None  # how a peer was lost, once one was: no collective after that

    def __init__(self, group: dist.ProcessGroup | None, timeout: timedelta) -> None:
        self.group: dist.ProcessGroup | None = None
        self.rank, self.world_size = 0, 1
        if dist.is_available() and dist.is_initialized():
            # new_group is collective: every rank constructs its Checkpointer together.
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self.group = gloo_group(
                lambda: dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            )
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)

    @contextlib.contextmanager
    def wire(self) -> Iterator[None]:
        """Around work on the group: refuse it once a peer was lost; note a loss, raised
        as a `PeerLostError` (in-process recovery takes it as a peer's failure)."""
        if self.lost is not None:
            raise PeerLostError(
                f"the checkpointer's process group lost a peer earlier ({self.lost[:200]}); "
                "it is not used again: restart the job, or let in-process recovery do it"
            )
        try:
            yield
        except Exception as e:
            if not lost_peer(e):
                raise
            said = brief(e)
            self.lost = self.lost or said
            if isinstance(e, PeerLostError):
                raise
            # One line a user can act on; gloo's own text (its source path, its advice to
            # check the remote worker's logs) stays in the cause, for a traceback.
            raise PeerLostError(
                f"the checkpointer's process group (rank {self.rank} of {self.world_size}) "
                f"lost a peer: another rank is gone ({said}); restart the job "
                "(`unbroken run --max-restarts`), or let in-process recovery replace it"
            ) from e

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.group is None:
            return [obj]
        with self.wire():
            return _all_gather(self.group, obj)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.group is None:
            return obj
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)])
        with self.wire(), lent(size):
            done(dist.broadcast(size, group=self.group, group_src=0, async_op=True))
        buf = torch.empty(int(size), dtype=torch.uint8)
        if self.rank == 0:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with self.wire(), lent(buf):
            done(dist.broadcast(buf, group=self.group, group_src=0, async_op=True))
        return json.loads(buf.numpy().tobytes())

    def broadcast_bytes(self, data: memoryview, src: int) -> None:
        """Fill ``data`` on every rank with its contents on rank ``src``."""
        if self.group is not None:
            tensor = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0)
            with self.wire(), lent(tensor):
                done(dist.broadcast(tensor, group=self.group, group_src=src, async_op=True))

    def all_reduce_max(self, values: torch.Tensor) -> None:
        """Every rank's ``values`` become the elementwise maximum over the ranks."""
        if self.group is not None:
            with self.wire(), lent(values):
                done(dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group, async_op=True))

    def p2p(self, kind: object, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.P2POp:
        """A send (``dist.isend``) or receive (``dist.irecv``) of ``tensor`` with ``peer``,
        for `start`."""
        return dist.P2POp(kind, tensor, group=self.group, tag=tag, group_peer=peer)  # type: ignore[arg-type]

    def start(self, ops: Sequence[dist.P2POp]) -> Transfers:
        """Start ``ops`` together (no order between pairs to deadlock on)."""
        return Transfers(ops)

    def together(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it fails on any rank, raise on every rank.

        A rank that fails still takes part in the exchange, so the others learn of the
        failure instead of waiting for a collective that never comes; unless ``fn`` lost a
        peer: then the exchange could only fail, or meet a peer still inside ``fn``."""
        return self._exchange(what, fn, share=False)[0]

    def gathered(self, what: str, fn: Callable[[], T]) -> list[T]:
        """`together`, returning every rank's result (JSON) in rank order: one exchange
        where `together` and `all_gather` would take two."""
        return self._exchange(what, fn, share=True)[1]

    def _attempt(self, fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
        """``fn()``, or its error, kept for the exchange that tells the other ranks;
        raised at once if it lost a peer (then no exchange could succeed)."""
        try:
            with self.wire():
                return fn(), None
        except Exception as e:
            if self.lost is not None:
                raise
            return None, e

    def _exchange(self, what: str, fn: Callable[[], T], share: bool) -> tuple[T, list[T]]:
        result, error = self._attempt(fn)
        shared = result if share and error is None else None
        rows = self.all_gather([None if error is None else str(error), shared])
        if error is not None:
            raise error
        if failures := [f"rank {r}: {e}" for r, (e, _) in enumerate(rows) if e is not None]:
            raise CheckpointError(f"{what} failed on another rank: {'; '.join(failures)}")
        return cast(T, result), [row[1] for row in rows]

    def close(self) -> None:
        """Release the group, the ranks agreeing to first (bounded by `CLOSE_WAIT_S`).

        A rank's DataLoader workers, forked after the group connected, hold copies of its
        sockets, so its peers see its connections end only when those workers exit, at a
        moment of their own; gloo ends the process (std::terminate in its event loop,
        "state_ <= CONNECTED") if that moment falls inside a peer's destroy. Destroyed
        together, the group is gone on every rank before any such moment."""
        if self.group is None or not dist.is_initialized():
            return
        if self.lost is None:
            with contextlib.suppress(Exception):  # a peer that is not closing: go on alone
                wait = timedelta(seconds=CLOSE_WAIT_S)
                dist.monitored_barrier(self.group, timeout=wait, wait_all_ranks=False)
        dist.destroy_process_group(self.group)
        self.group = None

    # -- rank 0 plans, the others get their part (issue 33: no rank decodes every row
    # but rank 0; every other rank's cost is its own row and its own part) ------------

    def gather(self, obj: Any, use: Callable[[list[Any]], R]) -> R | None:
        """``use`` of every rank's ``obj`` (JSON), in rank order, on rank 0; None on the
        others. ``use`` runs with the collector still paused for the decoding: what it
        drops (a save's plan keeps little of every rank's blocks) is freed before a
        collection would walk it."""
        if self.group is None:
            return use([obj])
        with self.wire():
            lengths, rows = _gather(self.group, json.dumps(obj).encode())
        if self.rank != 0:
            return None
        with building():  # every rank's blocks, on this rank alone
            return use(
                [
                    json.loads(row[:n].numpy().tobytes())
                    for row, n in zip(rows, lengths, strict=True)
                ]
            )

    def scatter(self, parts: list[Any] | None) -> Any:
        """``parts[r]`` of rank 0 (JSON, one per rank) on rank r; ``parts`` is read on
        rank 0 only. Padded with spaces to the longest part, whose size is broadcast."""
        if self.group is None:
            assert parts is not None
            return parts[0]
        out: list[torch.Tensor] = []
        size = torch.tensor([0])
        if self.rank == 0:
            assert parts is not None and len(parts) == self.world_size
            data = [json.dumps(p).encode() for p in parts]
            size[0] = max(len(d) for d in data)
            for d in data:
                t = torch.full((int(size),), ord(" "), dtype=torch.uint8)
                t[: len(d)] = torch.frombuffer(bytearray(d), dtype=torch.uint8)
                out.append(t)
        with self.wire(), lent(size):
            done(dist.broadcast(size, group=self.group, group_src=0, async_op=True))
        mine = torch.empty(int(size), dtype=torch.uint8)
        with self.wire(), lent(mine, *out):
            done(dist.scatter(mine, out or None, group=self.group, group_src=0, async_op=True))
        return json.loads(mine.numpy().tobytes())

    def planned(self, what: str, fn: Callable[[], T], plan: Callable[[list[T]], list[Any]]) -> Any:
        """`gathered` where only rank 0 needs every rank's result: each rank runs ``fn``,
        rank 0 gets the results and runs ``plan`` on them (one part per rank), and each
        rank returns its own part. A failure of ``fn`` on any rank, or of ``plan``, raises
        on every rank as `together`'s does."""
        result, error = self._attempt(fn)
        row = [None if error is None else str(error), result]
        parts, failed = self.gather(row, lambda rows: self._parts(what, rows, plan)) or (None, None)
        if failed is not None:
            error = failed
        failure, part = self.scatter(parts)
        if error is not None:
            raise error
        if failure is not None:
            raise CheckpointError(failure)
        return part

    def _parts(
        self, what: str, rows: list[Any], plan: Callable[[list[Any]], list[Any]]
    ) -> tuple[list[Any], Exception | None]:
        """Rank 0's parts: ``plan``'s, or for every rank what failed (the error ``plan``
        raised, if it did, for rank 0 to raise)."""
        failures = [f"rank {r}: {e}" for r, (e, _) in enumerate(rows) if e is not None]
        error = None
        if not failures:
            try:
                return [[None, p] for p in plan([row[1] for row in rows])], None
            except Exception as e:  # rank 0 raises it, the others hear of it
                error, failures = e, [f"rank 0: {e}"]
        failed = [f"{what} failed on another rank: {'; '.join(failures)}", None]
        return [failed] * self.world_size, error


def gloo_group(create: Callable[[], dist.ProcessGroup]) -> dist.ProcessGroup:
    """The gloo group ``create`` makes (collective), connecting lazily; under in-process
    recovery its ranks then share their listeners' addresses with `abort` (one
    all-gather, itself waited for in bounded waits: `abort` cannot know its connections
    yet), so that an abort reaches connections made at any later moment."""
    with abort.tracking() as listeners, _lazy():
        group = create()
    if abort.poll_s() is not None and dist.get_rank(group) >= 0:
        abort.adopt(listeners)
        rows = abort.waited("sharing a group's listeners", lambda: _all_gather(group, listeners))
        abort.adopt([(str(host), int(port)) for row in rows for host, port in row])
    return group


def _all_gather(group: dist.ProcessGroup, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON), in rank order, on every rank: gathered on the group's
    first rank (`_gather`), then broadcast down gloo's binomial tree. That is
    2 + 2·⌈log2 n⌉ sequential steps, where gloo's all_gather is a ring of ``n - 1``
    (seconds at thousands of ranks, for each of a save's or restore's exchanges:
    docs/scaling.md)."""
    lengths, rows = _gather(group, json.dumps(obj).encode())
    blob = torch.empty(sum(lengths), dtype=torch.uint8)
    if rows:
        blob[:] = torch.cat([row[:n] for row, n in zip(rows, lengths, strict=True)])
    with lent(blob):
        done(dist.broadcast(blob, group=group, group_src=0, async_op=True))
    with building():  # a save's rows: every rank's blocks
        return [json.loads(part.numpy().tobytes()) for part in blob.split(lengths)]


def _gather(group: dist.ProcessGroup, data: bytes) -> tuple[list[int], list[torch.Tensor]]:
    """Every rank's ``data`` length, on every rank, and on the group's first rank every
    rank's ``data``, padded to the longest (an empty list elsewhere). The lengths are
    gathered there and broadcast down gloo's binomial tree, so agreeing on the padding
    takes 1 + ⌈log2 n⌉ sequential steps, not an all_reduce's ring of ``n - 1``."""
    world, first = dist.get_world_size(group), dist.get_rank(group) == 0
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world if first else 0)]
    size = torch.tensor([len(data)])
    with lent(size, *counts):
        done(dist.gather(size, counts or None, group=group, group_dst=0, async_op=True))
    sizes = torch.cat(counts) if first else torch.zeros(world, dtype=torch.int64)
    with lent(sizes):
        done(dist.broadcast(sizes, group=group, group_src=0, async_op=True))
    lengths = [int(n) for n in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = [torch.empty_like(mine) for _ in range(world if first else 0)]
    with lent(mine, *rows):
        done(dist.gather(mine, rows or None, group=group, group_dst=0, async_op=True))
    return lengths, rows


@contextlib.contextmanager
def _lazy() -> Iterator[None]:
    """gloo groups created inside connect lazily (read at group creation)."""
    key = "TORCH_GLOO_LAZY_INIT"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def lost_peer(error: BaseException) -> bool:
    """Whether ``error``, or what caused it, says a connection to a peer is gone (or
    that the generation was aborted because a peer failed)."""
    return any(_gone(e) for e in _chain(error))


def brief(error: BaseException) -> str:
    """What the error deepest in ``error``'s chain that says a peer is gone (else
    ``error``) says, in one line: without gloo's source path, the sentences after its
    first (advice to read the remote worker's logs, a "GLHF!"), or C++ frames."""
    said = [e for e in _chain(error) if _gone(e)] or [error]
    for line in str(said[-1]).splitlines():
        line = _SOURCE.sub("", line).replace("GLHF!", "").strip()
        if line:
            return line.split(". ")[0].rstrip(".")[:200]
    return type(said[-1]).__name__


def _gone(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, dist.DistNetworkError | PeerLostError) or any(w in text for w in _GONE)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what caused it, and so on (each once)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__
