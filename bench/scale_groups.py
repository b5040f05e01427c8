# mypy: disallow-untyped-defs
"""The scale harness's group creation (bench/scale.py): the two gloo groups every rank
creates at each generation under ``unbroken run --in-process``, the generation's
default group (`unbroken.run.inprocess._join`) and the Checkpointer's
(`unbroken.job.comm.Comm`), both through `unbroken.job.comm.gloo_group`.

Each is a real `ProcessGroupGloo`, created by ``n`` threads at once (in the host
processes of bench/scale_hosts.py, 128 ranks each), each on a store connection of its
own (a real `TCPStore`) under the generation's prefix, through a store that counts the
requests gloo makes. The groups connect lazily (gloo's
``TORCH_GLOO_LAZY_INIT``, as `gloo_group` makes them): each rank publishes its listener's
address and reads those of the peers it first exchanges with, not the eager mesh's
``n - 1`` (which needed ``n * (n - 1)`` connections, two descriptors each, and stopped
at 64 ranks under this machine's 20,000 descriptors per process). What is left
out: `init_process_group`'s Python bookkeeping (no store request), and the listener
exchange `gloo_group` adds under in-process recovery: one all-gather on the new group,
a transport cost like the other exchanges' (bench/scale_metadata.py), not timed here.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

import scale_hosts
from unbroken.run import contract, listen

# Beyond it: projected. At 2,304 ranks the creations took 20 to 85 s per host process
# where 128 of them take 0.5 s alone (their CPU), and the run one to two minutes: this
# sandbox slows down under thousands of threads (gloo starts its own for each group).
MAX_RANKS = 2304
TIMEOUT = timedelta(seconds=120)


class Counting(dist.Store):
    """A store that counts the requests made through it into ``count`` (shared)."""

    def __init__(self, inner: Any, count: list[int]) -> None:
        super().__init__()
        self._inner, self._count = inner, count

    def _one(self) -> Any:
        self._count.append(1)  # atomic under the GIL, from any thread
        return self._inner

    def set(self, key: str, value: Any) -> None:
        self._one().set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._one().get(key))

    def add(self, key: str, value: int) -> int:
        return int(self._one().add(key, value))

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        inner = self._one()
        inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._one().check(keys))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._one().compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        return bool(self._one().delete_key(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(v) for v in self._one().multi_get(keys)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._one().multi_set(keys, values)

    def append(self, key: str, value: Any) -> None:
        self._one().append(key, value)

    def clone(self) -> Counting:
        return Counting(self._inner.clone(), self._count)

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: Any) -> None:
        self._inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return False


NAMES = ("default", "checkpointer")


def host(conn: Connection, index: int, world: int, port: int, ranks: list[int]) -> None:
    """One host process (bench/scale_hosts.py): ``ranks`` connect to the store, then
    create each group when told to, as threads; what each took and the requests made."""
    stores: dict[int, Any] = {}

    def connect(rank: int) -> None:
        stores[rank] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)

    _all(ranks, connect)  # not timed: each rank's connection is made at its start
    conn.send(("connected", index))
    prefix = f"{contract.GENERATION_PREFIX}1"
    count: list[int] = []
    for name in NAMES:
        conn.recv()  # go
        made: dict[int, Any] = {}
        errors: list[str] = []

        def create(rank: int, name: str = name, made: dict[int, Any] = made,
                   errors: list[str] = errors) -> None:  # fmt: skip
            try:
                # Kept alive here: the C++ side holds no Python reference to its override.
                counting = Counting(stores[rank], count)
                store = dist.PrefixStore(f"{prefix}/{name}", counting)
                made[rank] = (counting, dist.ProcessGroupGloo(store, rank, world, TIMEOUT))
            except Exception as e:
                errors.append(f"rank {rank}: {e}")

        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read as each group is made
        start = time.monotonic()
        _all(ranks, create)
        conn.send(("made", (start, time.monotonic())) if not errors else ("error", errors))
        del os.environ["TORCH_GLOO_LAZY_INIT"]
        # Dropped in parallel: a group's destructor waits on its connections.
        _all(ranks, made.pop)
        gc.collect()
        conn.send(("dropped", index))
    conn.send(("count", len(count)))
    conn.recv()  # stop: the connections close as the process exits, ~0.3 s each here


def _all(ranks: list[int], fn: Callable[[int], Any]) -> None:
    threads = [threading.Thread(target=fn, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(world: int) -> dict[str, Any]:
    """Both groups at ``world`` ranks: seconds (from the first rank's start to the last
    rank's end, per group) and store requests."""
    master = listen.store()
    ranks = [scale_hosts.ranks(nodes) for nodes in scale_hosts.split(world)]
    hosts = scale_hosts.Hosts(host, len(ranks), lambda i: (world, master.port, ranks[i]))
    seconds = 0.0
    try:
        hosts.gather("connected")
        for _ in NAMES:
            for i in range(len(ranks)):
                hosts.send(i, "go")
            spans = hosts.gather("made")
            seconds += max(end for _, end in spans) - min(start for start, _ in spans)
            hosts.gather("dropped")
        requests = sum(hosts.gather("count"))
        for i in range(len(ranks)):
            hosts.send(i, "stop")
    finally:
        hosts.close()
    alone = _alone(world, master.port)
    note = f"2 lazy gloo groups, threads, host processes: {len(ranks)}; a rank's alone "
    note += f"{alone * 1e3:.1f} ms"
    return {"s": seconds, "requests": requests, "note": note, "alone_s": alone}


def _alone(world: int, port: int, repeats: int = 5) -> float:
    """One rank's group at ``world`` ranks, made with nothing else running (as each rank
    of a cluster makes its own, at once): wall seconds, best of ``repeats``."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    best = float("inf")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        for i in range(repeats):
            start = time.perf_counter()
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"alone-{i}", store), 0, world, TIMEOUT)
            best = min(best, time.perf_counter() - start)
            del group
    finally:
        del os.environ["TORCH_GLOO_LAZY_INIT"]
    return best
