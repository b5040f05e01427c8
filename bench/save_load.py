"""Save/restore throughput of unbroken against per-rank ``torch.save``/``torch.load`` and
``torch.distributed.checkpoint`` (DCP), next to this machine's limits (memcpy, write+fsync,
read), all measured in one run on one state.

    python bench/save_load.py                                  # 2 ranks x 512 MiB, 3 repeats
    python bench/save_load.py --mib-per-rank 16 --repeats 1    # smoke, a few seconds

Each rank is a real process in a gloo group and holds a different shard (different keys and
data per rank), so every method writes ranks x MiB in total. Every save ends durable (fsync).
Before every read the page cache of every file under the bench directory is dropped with
``posix_fadvise(DONTNEED)`` and residency is checked with ``mincore``. Throughput is
aggregate: total bytes of all ranks / wall time of the slowest rank, clocks started after a
barrier. Methods are interleaved (order rotates each repeat) and the best repeat is reported:
on this shared VM interference only ever slows a run down (medians are in the RESULT json).
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
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import unbroken

GIB = 1 << 30
MIB = 1 << 20
CHUNK = 16 * MIB  # raw write/read syscall size
PAUSE_S = 1.0
TARGET_VS_DCP = 2.0
TARGET_OF_LIMIT = 0.8


@dataclass(frozen=True)
class Config:
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
    for i, (t, ref) in enumerate(zip(tensors, flat_views(reference, tensors), strict=True)):
        if not torch.equal(as_bytes(t), ref):
            raise AssertionError(
                f"{what}: tensor #{i} ({tuple(t.shape)}, {t.dtype}) differs from the saved data"
            )


# --------------------------------------------------------------------------- files


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
        for name in names:
            yield os.path.join(parent, name)


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


def torch_save(state: dict[str, Any], path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def torch_load_into(path: str, tensors: list[torch.Tensor]) -> None:
    # what load_state_dict does: load, then copy into the live tensors
    loaded = torch.load(path, weights_only=True)["model"]
    for t, src in zip(tensors, loaded.values(), strict=True):
        t.copy_(src)


# --------------------------------------------------------------------------- worker


def timed(fn: Callable[[], object]) -> float:
    """Seconds of the slowest rank, all clocks started after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def quiesce(*paths: Path) -> None:
    """Delete ``paths`` and flush the disk before the next clock starts: the root fs is
    mounted with ``discard``, so deletes and leftover writeback otherwise land in a timing."""
    if dist.get_rank() == 0:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        os.sync()
        # The virtual disk serves bursts faster than sustained writes: a pause lets every
        # method start from the same state instead of paying for the one before it.
        time.sleep(PAUSE_S)
    dist.barrier()


def fresh_dir(path: Path) -> str:
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    return str(path)


def worker(rank: int, cfg: Config) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg.port}",
        rank=rank,
        world_size=cfg.ranks,
        timeout=timedelta(seconds=120),
    )
    root = Path(cfg.dir)
    state = make_state(rank, cfg.mib_per_rank * MIB)
    tensors = list(state["model"].values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    # reference copy (never written again) and a scratch buffer, both touched before timing
    reference = torch.empty(nbytes, dtype=torch.uint8)
    for t, view in zip(tensors, flat_views(reference, tensors), strict=True):
        view.copy_(as_bytes(t))
    scratch = torch.zeros(nbytes, dtype=torch.uint8)
    ref_mv, scratch_mv = reference.numpy().data, scratch.numpy().data

    samples: dict[str, list[float]] = {}
    residency: list[float] = []

    def record(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(cfg.total_bytes / GIB / seconds)

    def before_restore() -> None:
        for t in tensors:  # a restore that writes nothing must fail verification
            t.zero_()
        scratch.zero_()
        dist.barrier()
        if rank == 0:
            residency.append(evict(cfg.dir))
        dist.barrier()

    def limits(rep: int) -> None:
        def memcpy() -> None:
            for t, view in zip(tensors, flat_views(scratch, tensors), strict=True):
                view.copy_(as_bytes(t))

        record("memcpy", timed(memcpy))
        verify(tensors, scratch, "memcpy")
        path = f"{fresh_dir(root / 'raw' / str(rep))}/rank{rank}.bin"
        early = f"{fresh_dir(root / 'raw' / f'{rep}-early')}/rank{rank}.bin"
        writers = [("write_fsync", path, False), ("write_fsync_early", early, True)]
        for name, where, early_writeback in writers[:: 1 if rep % 2 else -1]:  # alternate
            quiesce()
            record(name, timed(lambda: raw_write(where, ref_mv, early_writeback)))  # noqa: B023
        before_restore()
        record("read", timed(lambda: raw_read(path, scratch_mv)))
        if not torch.equal(scratch, reference):
            raise AssertionError("raw read: data differs from what was written")
        for t, view in zip(tensors, flat_views(reference, tensors), strict=True):
            as_bytes(t).copy_(view)  # undo before_restore's zeroing

    def per_rank_torch(rep: int) -> None:
        path = f"{fresh_dir(root / 'torch' / str(rep))}/rank{rank}.pt"
        record("torch_save", timed(lambda: torch_save(state, path)))
        before_restore()
        record("torch_load", timed(lambda: torch_load_into(path, tensors)))
        verify(tensors, reference, "torch.load")

    def distributed_checkpoint(rep: int) -> None:
        path = fresh_dir(root / "dcp" / str(rep))
        writer = dcp.FileSystemWriter(path)
        record("dcp_save", timed(lambda: dcp.save(state, storage_writer=writer)))
        before_restore()
        reader = dcp.FileSystemReader(path)
        record("dcp_load", timed(lambda: dcp.load(state, storage_reader=reader)))
        verify(tensors, reference, "dcp.load")

    ckpt = unbroken.Checkpointer(root / "unbroken")  # collective; default settings, keeps all

    def unbroken_checkpoint(rep: int) -> None:
        step = 1000 + rep
        record("unbroken_save", timed(lambda: ckpt.save(step, state)))
        before_restore()
        got: list[int | None] = []
        record("unbroken_restore", timed(lambda: got.append(ckpt.restore(state))))
        if got != [step]:
            raise AssertionError(f"unbroken restore returned step {got}, saved {step}")
        verify(tensors, reference, "unbroken restore")

    methods = [limits, unbroken_checkpoint, per_rank_torch, distributed_checkpoint]

    for rep in range(cfg.repeats):
        shift = rep % len(methods)  # interleave: each method runs in each slot over time
        for method in methods[shift:] + methods[:shift]:
            quiesce()
            method(rep)
            quiesce(root / "raw", *(root / sub / str(rep) for sub in ("torch", "dcp")))
        if rank == 0:
            done = ", ".join(f"{k} {v[-1]:.2f}" for k, v in samples.items())
            print(f"repeat {rep + 1}/{cfg.repeats} (GiB/s): {done}", flush=True)

    if rank == 0:
        out = {"samples": samples, "residency_after_evict": max(residency, default=0.0)}
        (root / "result.json").write_text(json.dumps(out))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- report


def report(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    samples: dict[str, list[float]] = raw["samples"]
    best = {k: max(v) for k, v in samples.items()}
    median = {k: statistics.median(v) for k, v in samples.items()}
    cold = raw["residency_after_evict"] < 0.01
    reads = (
        "cold (fadvise DONTNEED)" if cold else f"warm ({raw['residency_after_evict']:.0%} resident)"
    )
    # Saves are held against the better of the two raw writers: the machine's real limit.
    write_limit = max(best["write_fsync"], best["write_fsync_early"])
    read_limit = best["read"]
    rows: list[tuple[str, ...]] = [
        ("limit", "memcpy (preallocated)", f"{best['memcpy']:.2f}", f"{median['memcpy']:.2f}"),
        ("limit", "write + fsync", f"{best['write_fsync']:.2f}", f"{median['write_fsync']:.2f}"),
        (
            "limit",
            "write + fsync, early writeback",
            f"{best['write_fsync_early']:.2f}",
            f"{median['write_fsync_early']:.2f}",
        ),
        ("limit", f"read, {reads}", f"{read_limit:.2f}", f"{median['read']:.2f}"),
    ]
    fraction: dict[str, float] = {}
    ratio_vs_dcp = 0.0
    for label, save, restore in [
        ("unbroken", "unbroken_save", "unbroken_restore"),
        ("torch.save / torch.load", "torch_save", "torch_load"),
        ("DCP save / load", "dcp_save", "dcp_load"),
    ]:
        fraction[save] = best[save] / write_limit
        fraction[restore] = best[restore] / read_limit
        targets = {save: "", restore: ""}
        if label == "unbroken":
            ratio_vs_dcp = best[save] / best["dcp_save"]
            ok = ratio_vs_dcp >= TARGET_VS_DCP and fraction[save] >= TARGET_OF_LIMIT
            targets[save] = (
                f"{'PASS' if ok else 'FAIL'}: {ratio_vs_dcp:.2f}x DCP (>= {TARGET_VS_DCP:g}x), "
                f"{fraction[save]:.0%} of write (>= {TARGET_OF_LIMIT:.0%})"
            )
            ok = fraction[restore] >= TARGET_OF_LIMIT
            targets[restore] = (
                f"{'PASS' if ok else 'FAIL'}: {fraction[restore]:.0%} of read "
                f"(>= {TARGET_OF_LIMIT:.0%})"
            )
        for op, key in (("save", save), ("restore", restore)):
            figures = f"{best[key]:.2f}", f"{median[key]:.2f}", f"{fraction[key]:.0%}"
            rows.append((label, op, *figures, targets[key]))
    print_table(cfg, rows, reads)
    return {
        "config": asdict(cfg) | {"total_bytes": cfg.total_bytes},
        "statistic": "best of repeats",
        "reads": reads,
        "gib_per_s": best,
        "median_gib_per_s": median,
        "samples": samples,
        "limits": {"memcpy": best["memcpy"], "write": write_limit, "read": read_limit},
        "fraction_of_limit": fraction,
        "unbroken_save_vs_dcp_save": ratio_vs_dcp,
        "targets": {
            "save_vs_dcp": TARGET_VS_DCP,
            "save_of_write_limit": TARGET_OF_LIMIT,
            "restore_of_read_limit": TARGET_OF_LIMIT,
        },
    }


def print_table(cfg: Config, rows: list[tuple[str, ...]], reads: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{cfg.ranks} ranks x {cfg.mib_per_rank} MiB, {cfg.repeats} repeats, {cfg.dir}",
        caption=f"aggregate GiB/s (all ranks' bytes / slowest rank); best of repeats; "
        f"saves fsynced; reads {reads}; save % of write+fsync, restore % of read",
    )
    table.add_column("method")
    table.add_column("op")
    table.add_column("GiB/s", justify="right")
    table.add_column("median", justify="right")
    table.add_column("of limit", justify="right")
    table.add_column("target")
    for row in rows:
        table.add_row(*row)
    Console(width=140).print(table)


# --------------------------------------------------------------------------- main


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="the best is reported")
    parser.add_argument("--dir", help="on a real disk (default: a temp dir under /tmp or the repo)")
    args = parser.parse_args()
    if args.mib_per_rank < 16 or args.ranks < 1 or args.repeats < 1:
        parser.error("need --mib-per-rank >= 16, --ranks >= 1, --repeats >= 1")

    repo = Path(__file__).resolve().parent.parent
    parent = args.dir or (tempfile.gettempdir() if not on_tmpfs(tempfile.gettempdir()) else repo)
    Path(parent).mkdir(parents=True, exist_ok=True)
    if on_tmpfs(parent):
        parser.error(f"{parent} is in memory (tmpfs); pick a directory on a disk")
    workdir = tempfile.mkdtemp(prefix="unbroken-bench-", dir=parent)
    cfg = Config(args.ranks, args.mib_per_rank, args.repeats, workdir, free_port())
    # room for one copy per method in flight plus every unbroken step
    need = cfg.total_bytes * (3 + cfg.repeats) * 1.1
    if shutil.disk_usage(workdir).free < need:
        parser.error(f"{workdir} needs {need / GIB:.1f} GiB free")
    try:
        mp.spawn(worker, args=(cfg,), nprocs=cfg.ranks, join=True)
        raw = json.loads((Path(workdir) / "result.json").read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = report(cfg, raw)
    print("RESULT " + json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
