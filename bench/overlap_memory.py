"""Host memory of bench/overlap.py's methods: one rank in a fresh process per method (so
no other method's allocations linger in it), two saves in a few training steps, and the
most memory it held meanwhile over what the trained job held before the method existed.

Memory is the proportional set size (``Pss`` in ``/proc/PID/smaps_rollup``) of the
process and every process under it, sampled every 5 ms: a writer process of DCP's or
torch-checkpointing's counts, and pages two of them share count once. Staging buffers
live for a whole save, so a 5 ms sampler sees their peak.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from common import hand_back, join_gloo, leave_group
from overlap_job import EVERY, Method, make_model, remove, train_step

PERIOD_S = 0.005


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone meanwhile
    out: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss(root: int) -> int:
    """Bytes ``root`` and every process under it hold, shared pages shared out."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += _pss(pid)
        todo += _children(pid)
    return total


class Peak:
    """The most this process's tree held while the block ran, over what it held before."""

    def __init__(self) -> None:
        self.base = self.peak = tree_pss(os.getpid())
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        me = os.getpid()
        while not self._done.wait(PERIOD_S):
            self.peak = max(self.peak, tree_pss(me))

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


def memory_worker(rank: int, port: int, root: str, mib: int, name: str) -> None:
    """One rank: the job trained, then the method made, prepared and used for two saves
    ``EVERY`` steps apart, each waited for, under `Peak`."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    join_gloo(rank, 1, port, timeout_s=300)
    model, optim = make_model(mib, 0)
    for _ in range(2):  # AdamW's state exists, as in the timed run
        train_step(model, optim, lambda s: s())
    with Peak() as peak:
        method = Method(name, Path(root) / f"memory-{name}", model, optim)
        method.prepare()
        for n in range(2 * EVERY):
            train_step(model, optim, method.guard)
            if n % EVERY == 0:
                if method.pending is not None:
                    method.pending()
                method.save(n)
        method.pending()
        method.close()
    remove(Path(root) / f"memory-{name}")
    out: dict[str, Any] = {"extra": peak.extra, "base": peak.base}
    hand_back(root, out, f"memory-{name}.json")
    leave_group()
