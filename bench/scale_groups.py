# mypy: disallow-untyped-defs
"""The scale harness's group creation (bench/scale.py): the two gloo groups every rank
creates at each generation under ``unbroken run --in-process``, the generation's
default group (`unbroken.run.inprocess._join`) and the Checkpointer's
(`unbroken.job.comm.Comm`), both through `unbroken.job.comm.gloo_group`.

Each is a real `ProcessGroupGloo`, created by ``n`` threads of this process at once, each
on a store connection of its own (a real `TCPStore`) under the generation's prefix,
through a store that counts the requests gloo makes. The groups connect lazily (gloo's
``TORCH_GLOO_LAZY_INIT``, as `gloo_group` makes them): each rank publishes its listener's
address and reads those of the peers it first exchanges with, not the eager mesh's
``n - 1`` (which needed ``n * (n - 1)`` connections, two descriptors each in one
process, and stopped at 64 ranks under this machine's 20,000 descriptors). What is left
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
from typing import Any

import torch.distributed as dist

from unbroken.run import contract, listen

# Per rank, 3 descriptors in this process (listener, store client, the store's end of it)
# and gloo's own: 4,096 ranks pass the 20,000 this machine allows.
MAX_RANKS = 2304
CALIBRATION = (16, 32)  # measured too where the harness runs smaller sizes, for the fit
TIMEOUT = timedelta(seconds=120)
_KEPT: list[Any] = []


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


def _groups(world: int, port: int, count: list[int]) -> float:
    """Both groups, by every rank at once; seconds from the start to the last rank."""
    stores: list[Any] = [None] * world

    def connect(rank: int) -> None:
        stores[rank] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)

    _all(world, connect)  # not timed: each rank's connection is made at its start
    prefix = f"{contract.GENERATION_PREFIX}1"
    seconds = 0.0
    for name in ("default", "checkpointer"):
        made: list[Any] = [None] * world
        errors: list[str] = []

        def create(
            rank: int, name: str = name, made: list[Any] = made, errors: list[str] = errors
        ) -> None:
            try:
                # Kept alive here: the C++ side holds no Python reference to its override.
                counting = Counting(stores[rank], count)
                store = dist.PrefixStore(f"{prefix}/{name}", counting)
                group = dist.ProcessGroupGloo(store, rank, world, TIMEOUT)
                made[rank] = (counting, group)
            except Exception as e:
                errors.append(f"rank {rank}: {e}")

        start = time.perf_counter()
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read as each group is made
        try:
            _all(world, create)
        finally:
            del os.environ["TORCH_GLOO_LAZY_INIT"]
        seconds += time.perf_counter() - start
        if errors:
            raise RuntimeError(f"group creation, {world} ranks: {errors[:3]}")

        # Its sockets closed, so the next group fits in the descriptors; in parallel: a
        # group's destructor waits on its connections (seconds for 64 ranks, one by one).
        def drop(rank: int, made: list[Any] = made) -> None:
            made[rank] = None

        _all(world, drop)
        gc.collect()
    _KEPT.extend(stores)  # closing a client connection takes ~0.3 s here: at exit, once
    return seconds


def _all(world: int, fn: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=fn, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(world: int) -> dict[str, Any]:
    """Both groups at ``world`` ranks: seconds and store requests."""
    master = listen.store()
    count: list[int] = []
    seconds = _groups(world, master.port, count)
    return {"s": seconds, "requests": len(count), "note": "2 lazy gloo groups, threads"}
