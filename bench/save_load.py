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

import os
import shutil
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import unbroken
from common import (
    GIB,
    MIB,
    TARGET_OF_LIMIT,
    DiskConfig,
    as_bytes,
    disk_config,
    evict,
    flat_views,
    fresh_dir,
    fsync_dir,
    hand_back,
    join_gloo,
    leave_group,
    make_state,
    new_table,
    print_result,
    raw_read,
    raw_write,
    read_back,
    rotated,
    run_ranks,
    settle,
    show,
    timed,
    verify,
)

# bench/recovery_worker.py imports `evict` from this module, and DCP with it, inside the
# setup phase it times for scenario (a): keep it importable from here.
from limits import STREAMS, aligned, check_limits, striped_read, striped_write

TARGET_VS_DCP = 2.0
Row = tuple[str, ...]


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


class SaveLoadRank:
    """One rank's side of the benchmark: its shard, a reference copy of it, and one method
    per way of saving and restoring it."""

    def __init__(self, rank: int, cfg: DiskConfig) -> None:
        self.rank, self.cfg = rank, cfg
        self.root = Path(cfg.dir)
        self.state = make_state(rank, cfg.mib_per_rank * MIB)
        self.tensors = list(self.state["model"].values())
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        # reference copy (never written again) and a scratch buffer, both touched before timing
        self.reference = torch.empty(nbytes, dtype=torch.uint8)
        for t, view in zip(self.tensors, flat_views(self.reference, self.tensors), strict=True):
            view.copy_(as_bytes(t))
        self.scratch = torch.zeros(nbytes, dtype=torch.uint8)
        self.ref_mv, self.scratch_mv = self.reference.numpy().data, self.scratch.numpy().data
        self.ref_direct = aligned(self.ref_mv)  # the direct writer's source: page-aligned
        self.samples: dict[str, list[float]] = {}
        self.residency: list[float] = []
        self.ckpt = unbroken.Checkpointer(self.root / "unbroken")  # collective; keeps all

    def record(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(self.cfg.total_bytes / GIB / seconds)

    def before_restore(self) -> None:
        for t in self.tensors:  # a restore that writes nothing must fail verification
            t.zero_()
        self.scratch.zero_()
        dist.barrier()
        if self.rank == 0:
            self.residency.append(evict(self.cfg.dir))
        dist.barrier()

    # The limits: each writer is a method of its own, rotated through the slots as the
    # others are, so none of them always writes right after another write (this VM's disk
    # serves a burst after a rest faster than back-to-back writes).

    def limit_plain(self, rep: int) -> None:
        """memcpy, then one sequential writer and reader per rank."""
        tensors, scratch = self.tensors, self.scratch

        def memcpy() -> None:
            for t, view in zip(tensors, flat_views(scratch, tensors), strict=True):
                view.copy_(as_bytes(t))

        self.record("memcpy", timed(memcpy))
        verify(tensors, scratch, "memcpy")
        path = f"{fresh_dir(self.root / 'raw' / str(rep))}/rank{self.rank}.bin"
        self.record("write_fsync", timed(lambda: raw_write(path, self.ref_mv)))
        self.raw_read("read", lambda: raw_read(path, self.scratch_mv))

    def limit_early(self, rep: int) -> None:
        path = f"{fresh_dir(self.root / 'raw' / f'{rep}-early')}/rank{self.rank}.bin"
        self.record("write_fsync_early", timed(lambda: raw_write(path, self.ref_mv, True)))

    def limit_striped(self, rep: int) -> None:
        path = f"{fresh_dir(self.root / 'raw' / f'{rep}-striped')}/rank{self.rank}.bin"
        self.record("write_fsync_striped", timed(lambda: striped_write(path, self.ref_mv)))
        self.raw_read("read_striped", lambda: striped_read(path, self.scratch_mv))

    def limit_direct(self, rep: int) -> None:
        path = f"{fresh_dir(self.root / 'raw' / f'{rep}-direct')}/rank{self.rank}.bin"
        write = lambda: striped_write(path, self.ref_direct, direct=True)  # noqa: E731
        self.record("write_direct_striped", timed(write))

    def raw_read(self, name: str, read: Callable[[], None]) -> None:
        self.before_restore()
        self.record(name, timed(read))
        if not torch.equal(self.scratch, self.reference):
            raise AssertionError(f"raw {name}: data differs from what was written")
        for t, view in zip(self.tensors, flat_views(self.reference, self.tensors), strict=True):
            as_bytes(t).copy_(view)  # undo before_restore's zeroing

    def per_rank_torch(self, rep: int) -> None:
        path = f"{fresh_dir(self.root / 'torch' / str(rep))}/rank{self.rank}.pt"
        self.record("torch_save", timed(lambda: torch_save(self.state, path)))
        self.before_restore()
        self.record("torch_load", timed(lambda: torch_load_into(path, self.tensors)))
        verify(self.tensors, self.reference, "torch.load")

    def distributed_checkpoint(self, rep: int) -> None:
        path = fresh_dir(self.root / "dcp" / str(rep))
        writer = dcp.FileSystemWriter(path)
        self.record("dcp_save", timed(lambda: dcp.save(self.state, storage_writer=writer)))
        self.before_restore()
        reader = dcp.FileSystemReader(path)
        self.record("dcp_load", timed(lambda: dcp.load(self.state, storage_reader=reader)))
        verify(self.tensors, self.reference, "dcp.load")

    def unbroken_checkpoint(self, rep: int) -> None:
        step = 1000 + rep
        self.record("unbroken_save", timed(lambda: self.ckpt.save(step, self.state)))
        self.before_restore()
        got: list[int | None] = []
        self.record("unbroken_restore", timed(lambda: got.append(self.ckpt.restore(self.state))))
        if got != [step]:
            raise AssertionError(f"unbroken restore returned step {got}, saved {step}")
        verify(self.tensors, self.reference, "unbroken restore")

    def run(self) -> dict[str, Any]:
        """Every method once per repeat, interleaved, the disk settled around each."""
        methods = [
            self.limit_plain,
            self.limit_early,
            self.limit_striped,
            self.limit_direct,
            self.unbroken_checkpoint,
            self.per_rank_torch,
            self.distributed_checkpoint,
        ]
        root = self.root
        for rep in range(self.cfg.repeats):
            for method in rotated(methods, rep):  # each method runs in each slot over time
                settle()
                method(rep)
                settle(root / "raw", *(root / sub / str(rep) for sub in ("torch", "dcp")))
            if self.rank == 0:
                done = ", ".join(f"{k} {v[-1]:.2f}" for k, v in self.samples.items())
                print(f"repeat {rep + 1}/{self.cfg.repeats} (GiB/s): {done}", flush=True)
        return {"samples": self.samples, "residency_after_evict": max(self.residency, default=0.0)}


def worker(rank: int, cfg: DiskConfig) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, cfg.ranks, cfg.port, timeout_s=120)
    bench = SaveLoadRank(rank, cfg)
    hand_back(cfg.dir, bench.run())
    bench.ckpt.close()
    leave_group()


# --------------------------------------------------------------------------- report


def report(cfg: DiskConfig, raw: dict[str, Any]) -> dict[str, Any]:
    """Print the table; return the RESULT json."""
    samples: dict[str, list[float]] = raw["samples"]
    best = {k: max(v) for k, v in samples.items()}
    median = {k: statistics.median(v) for k, v in samples.items()}
    cold = raw["residency_after_evict"] < 0.01
    reads = (
        "cold (fadvise DONTNEED)" if cold else f"warm ({raw['residency_after_evict']:.0%} resident)"
    )
    # A method's median against the best sample of the fastest raw writer or reader,
    # striped ones included: the limit an upper bound with at least the parallelism of any
    # method, and one burst of this VM's disk unable to make a method's figure.
    writers = ("write_fsync", "write_fsync_early", "write_fsync_striped", "write_direct_striped")
    write_limit = max(best[k] for k in writers)
    read_limit = max(best["read"], best["read_striped"])
    fraction: dict[str, float] = {}
    rows = limit_rows(best, median, reads)
    ratio_vs_dcp = method_rows(rows, fraction, best, median, write_limit, read_limit)
    print_table(cfg, rows, reads)
    return {
        "config": asdict(cfg) | {"total_bytes": cfg.total_bytes},
        "statistic": "best of repeats; fractions: medians over the limits' best",
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


def limit_rows(best: dict[str, float], median: dict[str, float], reads: str) -> list[Row]:
    return [
        ("limit", "memcpy (preallocated)", f"{best['memcpy']:.2f}", f"{median['memcpy']:.2f}"),
        ("limit", "write + fsync", f"{best['write_fsync']:.2f}", f"{median['write_fsync']:.2f}"),
        (
            "limit",
            "write + fsync, early writeback",
            f"{best['write_fsync_early']:.2f}",
            f"{median['write_fsync_early']:.2f}",
        ),
        (
            "limit",
            f"write + fsync, {STREAMS} files in parallel",
            f"{best['write_fsync_striped']:.2f}",
            f"{median['write_fsync_striped']:.2f}",
        ),
        (
            "limit",
            f"O_DIRECT write + fsync, {STREAMS} files",
            f"{best['write_direct_striped']:.2f}",
            f"{median['write_direct_striped']:.2f}",
        ),
        ("limit", f"read, {reads}", f"{best['read']:.2f}", f"{median['read']:.2f}"),
        (
            "limit",
            f"read, {STREAMS} files in parallel",
            f"{best['read_striped']:.2f}",
            f"{median['read_striped']:.2f}",
        ),
    ]


def method_rows(
    rows: list[Row],
    fraction: dict[str, float],
    best: dict[str, float],
    median: dict[str, float],
    write_limit: float,
    read_limit: float,
) -> float:
    """Append each method's save and restore rows to ``rows`` and their fractions of the
    limits to ``fraction``; return unbroken's save speed over DCP's."""
    ratio_vs_dcp = 0.0
    for label, save, restore in [
        ("unbroken", "unbroken_save", "unbroken_restore"),
        ("torch.save / torch.load", "torch_save", "torch_load"),
        ("DCP save / load", "dcp_save", "dcp_load"),
    ]:
        fraction[save] = median[save] / write_limit
        fraction[restore] = median[restore] / read_limit
        targets = {save: "", restore: ""}
        if label == "unbroken":
            ratio_vs_dcp = median[save] / median["dcp_save"]
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
    return ratio_vs_dcp


def print_table(cfg: DiskConfig, rows: list[Row], reads: str) -> None:
    table = new_table(
        f"{cfg.ranks} ranks x {cfg.mib_per_rank} MiB, {cfg.repeats} repeats, {cfg.dir}",
        f"aggregate GiB/s (all ranks' bytes / slowest rank), best and median of repeats; "
        f"saves fsynced; reads {reads}; 'of limit': the median save over the fastest raw "
        "writer's best, the median restore over the fastest reader's best",
        [
            ("method", "left"),
            ("op", "left"),
            ("GiB/s", "right"),
            ("median", "right"),
            ("of limit", "right"),
            ("target", "left"),
        ],
    )
    for row in rows:
        table.add_row(*row)
    show(140, table)


# --------------------------------------------------------------------------- main


def main() -> None:
    cfg = disk_config(
        __doc__.split("\n\n")[0],
        repeats_help="the best is reported",
        min_repeats=1,
        prefix="unbroken-bench-",
        copies=lambda repeats: 4 + repeats,  # one per method in flight, every unbroken step
    )
    workdir = cfg.dir
    try:
        run_ranks(worker, (cfg,), cfg.ranks)
        raw = read_back(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = report(cfg, raw)
    print_result(result)
    check_limits(result["fraction_of_limit"], "bench/save_load.py")


if __name__ == "__main__":
    main()
