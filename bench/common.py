"""What every bench script shares: the synthetic state, ranks spawned into a gloo group,
timing on the slowest rank, cold-cache eviction, raw disk IO, work directories and ports,
the rich table and the closing ``RESULT {json}`` line.

Imported by the worker processes too (bench/recovery_worker.py, through bench/save_load.py,
inside a timed phase): rich is imported only where a table is printed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from rich.table import Table

GIB = 1 << 30
MIB = 1 << 20
CHUNK = 16 * MIB  # raw write/read syscall size
PAUSE_S = 1.0  # disk rest between methods (see settle)
TARGET_OF_LIMIT = 0.8  # unbroken's saves and restores, as a fraction of the disk's limits
RESULT_FILE = "result.json"  # what rank 0 hands back to the parent process

T = TypeVar("T")


@dataclass(frozen=True)
class DiskConfig:
    """A run of bench/save_load.py or bench/async_save.py: ``ranks`` processes, each
    holding ``mib_per_rank`` MiB, measured ``repeats`` times in ``dir``, meeting at
    ``port``."""

    ranks: int
    mib_per_rank: int
    repeats: int
    dir: str
    port: int

    @property
    def total_bytes(self) -> int:
        return self.ranks * self.mib_per_rank * MIB


# --------------------------------------------------------------------------- state


def layout(total: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """A model shard plus optimizer state: 4 big tensors (60 %), 32 medium (35 %) and 256
    small (5 %) of varied sizes, summing to exactly ``total`` bytes."""
    rng = random.Random(0)  # same layout on every rank; only the data differs
    bf16, fp32 = torch.bfloat16, torch.float32
    big = [
        ("embed.weight", bf16),
        ("lm_head.weight", bf16),
        ("optim.embed.exp_avg", fp32),
        ("optim.embed.exp_avg_sq", fp32),
    ]
    mid = [
        (f"layers.{i // 4}.{('attn.qkv', 'attn.out', 'mlp.up', 'mlp.down')[i % 4]}.weight", bf16)
        for i in range(32)
    ]
    small = [
        (f"layers.{i // 32}.norm{i % 32}.{('weight', 'bias')[i % 2]}", fp32) for i in range(256)
    ]
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    used = 0
    for group, share, two_d in ((big, 0.60, True), (mid, 0.35, True), (small, 0.05, False)):
        weights = [rng.uniform(0.5, 1.5) for _ in group]
        for (name, dtype), w in zip(group, weights, strict=True):
            size = dtype.itemsize
            # multiples of 512 elements keep every tensor aligned in the flat buffers
            numel = max(512, int(total * share * w / sum(weights)) // size // 512 * 512)
            out.append((name, (numel // 512, 512) if two_d else (numel,), dtype))
            used += numel * size
    rest = total - used
    if rest <= 0 or rest % 1024:
        raise SystemExit(f"--mib-per-rank too small for the layout ({total} bytes)")
    out.append(("layers.tail.bias", (rest // 2,), bf16))
    return out


def make_state(rank: int, total: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's shard of ``total`` bytes: the same layout on every rank, different keys
    and data."""
    gen = torch.Generator().manual_seed(1234 + rank)
    tensors = {}
    for name, shape, dtype in layout(total):
        # rank-prefixed keys: a shard, not a replica (DCP dedups plain tensors by key)
        tensors[f"rank{rank}.{name}"] = torch.empty(shape, dtype=dtype).uniform_(
            -1, 1, generator=gen
        )
    return {"model": tensors}


def flat_views(buf: torch.Tensor, tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Byte views of ``buf`` laid out like ``tensors`` back to back."""
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        yield buf[offset : offset + n]
        offset += n


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def verify(tensors: list[torch.Tensor], reference: torch.Tensor, what: str) -> None:
    """Raise unless ``tensors`` hold the bytes of ``reference`` (laid out as flat_views)."""
    for i, (t, ref) in enumerate(zip(tensors, flat_views(reference, tensors), strict=True)):
        if not torch.equal(as_bytes(t), ref):
            raise AssertionError(
                f"{what}: tensor #{i} ({tuple(t.shape)}, {t.dtype}) differs from the saved data"
            )


# --------------------------------------------------------------------------- cold cache


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MAP_FAILED = ctypes.c_void_p(-1).value


def resident(path: str) -> tuple[int, int]:
    """(pages in the page cache, pages) of a file, from mincore(2)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = np.zeros(pages, dtype=np.uint8)
            if _libc.mincore(addr, size, vec.ctypes.data) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return int((vec & 1).sum()), pages


def files(root: str) -> Iterator[str]:
    for parent, _, names in os.walk(root):
        paths = (os.path.join(parent, name) for name in names)
        yield from (p for p in paths if os.path.isfile(p))  # not a server's sockets


def evict(root: str) -> float:
    """Drop every file under ``root`` from the page cache (all are fsynced, hence clean);
    return the fraction still resident."""
    for path in files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    counts = [resident(p) for p in files(root)]
    total = sum(n for _, n in counts)
    return sum(r for r, _ in counts) / total if total else 0.0


# --------------------------------------------------------------------------- raw disk IO


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(path: str, data: memoryview, early_writeback: bool = False) -> None:
    """Sequential write + fsync. With ``early_writeback``, ask the kernel to start writing
    each chunk to disk as soon as it is in the page cache (sync_file_range), so the disk
    works while the next chunk is copied: the best a writer can do on this machine."""
    with open(path, "wb", buffering=0) as f:
        for off in range(0, len(data), CHUNK):
            f.write(data[off : off + CHUNK])
            if early_writeback:
                _sync_file_range(f.fileno(), off, CHUNK, 2)  # SYNC_FILE_RANGE_WRITE
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


_sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
_sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def raw_read(path: str, into: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < len(into):
            n = f.readinto(into[off : off + CHUNK])
            if not n:
                raise EOFError(path)
            off += n


# --------------------------------------------------------------------------- ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join the default gloo group of ``world`` spawned ranks meeting at ``port``; a rank
    that does not come, or a collective that hangs, fails after ``timeout_s``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], ranks: int) -> None:
    """``worker(rank, *args)`` in ``ranks`` fresh processes; returns when all are done, and
    raises if one fails."""
    mp.spawn(worker, args=args, nprocs=ranks, join=True)


def hand_back(directory: str | Path, out: Any, name: str = RESULT_FILE) -> None:
    """Rank 0 leaves ``out`` (JSON) in ``directory`` for the parent (`read_back`)."""
    if dist.get_rank() == 0:
        (Path(directory) / name).write_text(json.dumps(out))


def read_back(directory: str | Path, name: str = RESULT_FILE) -> Any:
    return json.loads((Path(directory) / name).read_text())


def leave_group() -> None:
    """The last collective: every rank is done, then the default group goes."""
    dist.barrier()
    dist.destroy_process_group()


def timed(fn: Callable[[], object]) -> float:
    """Seconds of the slowest rank, all clocks started after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def max_over_ranks(*values: float) -> list[float]:
    out = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return [float(v) for v in out.tolist()]


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """``items`` starting at ``rep`` (mod their number): run in this order, every method
    takes every slot over the repeats, so no method always follows the same one."""
    shift = rep % len(items)
    return [*items[shift:], *items[:shift]]


def fresh_dir(path: Path) -> str:
    """Create ``path`` (rank 0) before any rank writes in it."""
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    return str(path)


def settle(*paths: Path, pause_s: float = PAUSE_S) -> None:
    """Delete ``paths`` and flush the disk before the next clock starts: the root fs is
    mounted with ``discard``, so deletes and leftover writeback otherwise land in a timing."""
    if dist.get_rank() == 0:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        os.sync()
        # The virtual disk serves bursts faster than sustained writes: a pause lets every
        # method start from the same state instead of paying for the one before it.
        time.sleep(pause_s)
    dist.barrier()


# --------------------------------------------------------------------------- the run


def on_tmpfs(path: str | Path) -> bool:
    real = os.path.realpath(path).rstrip("/") + "/"
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, kind = line.split()[:3]
            mount = mount.rstrip("/") + "/"
            if real.startswith(mount) and len(mount) > len(best):
                best, fstype = mount, kind
    return fstype in {"tmpfs", "ramfs"}


def disk_workdir(parser: argparse.ArgumentParser, where: str | None, prefix: str) -> str:
    """A fresh temp dir on a real disk: under ``where`` if given, else under /tmp, or under
    the repository where /tmp is in memory; a usage error if it would be in memory."""
    repo = Path(__file__).resolve().parent.parent
    parent = where or (tempfile.gettempdir() if not on_tmpfs(tempfile.gettempdir()) else repo)
    Path(parent).mkdir(parents=True, exist_ok=True)
    if on_tmpfs(parent):
        parser.error(f"{parent} is in memory (tmpfs); pick a directory on a disk")
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def disk_config(
    description: str,
    *,
    repeats_help: str,
    min_repeats: int,
    prefix: str,
    copies: Callable[[int], int],
) -> DiskConfig:
    """The command line of a disk benchmark (bench/save_load.py, bench/async_save.py): 2
    ranks x 512 MiB and 5 repeats by default, in a fresh work directory ``prefix``* on a
    disk with room for ``copies(repeats)`` copies of all ranks' state."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help=repeats_help)
    parser.add_argument("--dir", help="on a real disk (default: a temp dir under /tmp or the repo)")
    args = parser.parse_args()
    if args.mib_per_rank < 16 or args.ranks < 1 or args.repeats < min_repeats:
        parser.error(f"need --mib-per-rank >= 16, --ranks >= 1, --repeats >= {min_repeats}")

    workdir = disk_workdir(parser, args.dir, prefix)
    cfg = DiskConfig(args.ranks, args.mib_per_rank, args.repeats, workdir, free_port())
    need = cfg.total_bytes * copies(cfg.repeats) * 1.1
    if shutil.disk_usage(workdir).free < need:
        parser.error(f"{workdir} needs {need / GIB:.1f} GiB free")
    return cfg


def print_result(result: dict[str, Any]) -> None:
    """The line a script ends with, for whatever reads its output."""
    print("RESULT " + json.dumps(result, separators=(",", ":")))


# --------------------------------------------------------------------------- tables

Justify = Literal["left", "right"]


def new_table(title: str, caption: str, columns: Sequence[tuple[str, Justify]]) -> Table:
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for name, justify in columns:
        table.add_column(name, justify=justify)
    return table


def show(width: int, *tables: Table) -> None:
    from rich.console import Console

    console = Console(width=width)
    for table in tables:
        console.print(table)
