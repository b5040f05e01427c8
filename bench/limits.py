"""Honest limits, shared by the bench scripts: raw writers and readers with at least the
parallelism of any method measured beside them, and the check that fails a run where a
method beats its limit (then the limit was not one)."""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor

from common import CHUNK, fsync_dir, raw_read, raw_write

# A limit is the fastest way found to move the bytes, so no method may beat it; one that does
# by more than timing noise (LIMIT_MARGIN) shows a limit measured wrong, and the script fails.
LIMIT_MARGIN = 0.05
# The striped limits: files (each with its own thread) per rank, as many as unbroken's writers
# and readers could use at once, so a limit never has less parallelism than a method.
STREAMS = 4


def direct_write(path: str, data: memoryview) -> None:
    """Sequential O_DIRECT writes from ``data`` itself (page-aligned: `aligned`) + fsync:
    past the page cache with no copy at all, the least a direct writer can do; the last
    partial block buffered, as a direct write cannot carry it."""
    whole = len(data) - len(data) % mmap.PAGESIZE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, whole, CHUNK):
            os.pwrite(fd, data[off : min(off + CHUNK, whole)], off)
        if whole < len(data):
            os.close(fd)
            fd = os.open(path, os.O_WRONLY)
            os.pwrite(fd, data[whole:], whole)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def aligned(data: memoryview) -> memoryview:
    """A copy of ``data`` in page-aligned memory (an anonymous map), for `direct_write`."""
    out = mmap.mmap(-1, max(1, len(data)))
    out[: len(data)] = data.cast("B")
    return memoryview(out)[: len(data)]


def _stripes(data: memoryview, streams: int) -> list[memoryview]:
    size = -(-len(data) // streams // mmap.PAGESIZE) * mmap.PAGESIZE  # aligned: direct too
    return [data[off : off + size] for off in range(0, len(data), size)]


def striped_write(
    path: str, data: memoryview, streams: int = STREAMS, direct: bool = False
) -> None:
    """`raw_write` (early writeback) of ``data`` cut into ``streams`` slices, each to its
    own file ``path.<i>`` by its own thread: the parallel limit (see `STREAMS`). With
    ``direct``, `direct_write`s from ``data`` (page-aligned) instead."""
    parts = _stripes(data, streams)

    def one(i: int) -> None:
        if direct:
            direct_write(f"{path}.{i}", parts[i])
        else:
            raw_write(f"{path}.{i}", parts[i], True)

    with ThreadPoolExecutor(len(parts)) as pool:
        list(pool.map(one, range(len(parts))))


def striped_read(path: str, into: memoryview, streams: int = STREAMS) -> None:
    """Read back what `striped_write` wrote, one thread per file."""
    parts = _stripes(into, streams)
    with ThreadPoolExecutor(len(parts)) as pool:
        list(pool.map(lambda i: raw_read(f"{path}.{i}", parts[i]), range(len(parts))))


def check_limits(fractions: dict[str, float], what: str) -> None:
    """Exit non-zero (after the table and RESULT line are out) if a method went faster than
    its limit by more than `LIMIT_MARGIN`: that limit was not one, and the run's percentages
    mean nothing. ``fractions``: method -> its speed over its limit's."""
    over = {k: v for k, v in fractions.items() if v > 1 + LIMIT_MARGIN}
    if over:
        figures = ", ".join(f"{k} {v:.0%}" for k, v in sorted(over.items()))
        raise SystemExit(
            f"{what}: {figures} of the limit (> {1 + LIMIT_MARGIN:.0%} allowed for noise): "
            "the limit was measured with less parallelism than the method, or the disk "
            "changed speed during the run; fix the limit or re-run on a quiet machine"
        )
