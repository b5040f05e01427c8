# mypy: disallow-untyped-defs
"""Restoring on another number of ranks: a state saved on 4 ranks restored on 2 and on 1,
from local disk and from an S3 server, by unbroken and by DCP's resharding load, next to a
cold-read limit measured beside them, all in one run.

    python bench/reshard.py                                  # 1 GiB state, Ceph RGW, 3 repeats
    python bench/reshard.py --mib 64 --repeats 1 --server moto    # smoke

The state is FSDP2-like: the tensors of bench/common.py's layout (big and medium 2-D
tensors, small 1-D ones) as DTensors sharded on dim 0 (``Shard(0)``) over the saving
ranks, uneven where the rows do not divide. It is saved once (untimed) on 4 ranks, by
unbroken to local disk and to S3 and by ``torch.distributed.checkpoint`` (DCP,
FileSystemWriter) to local disk. Then, on 2 ranks and on 1 (real processes in a gloo
group, the same DTensors on a 1-D mesh of their number), each method restores in place:

- unbroken: ``Checkpointer(path).restore(state)`` with default options;
- DCP: ``dcp.load(state, storage_reader=FileSystemReader(path))`` (it reshards by its
  planner); on S3 it is n/a (FileSystemReader reads local files);
- limit: each rank reads exactly the byte ranges of the unbroken checkpoint its shards
  need (adjacent ranges merged, no checksums, no format), into a preallocated buffer:
  from disk by as many threads as unbroken's ``io_threads``, with ``os.preadv`` in 16 MiB
  calls; from S3 by parallel ranged GETs with unbroken's client and request concurrency,
  cut as unbroken's planner cuts them (`unbroken.format.coalesce`: its request size and grid).
  unbroken reads the same bytes and more (whole 1 MiB checksum pieces), so the limit
  bounds it from above.

Every local read is cold: the page cache of every file under the work directory is
dropped with ``posix_fadvise(DONTNEED)`` before it (residency checked with ``mincore``).
Throughput is the state's bytes / wall time of the slowest rank, clocks started after a
barrier; methods rotate each repeat; the best repeat is reported with the median beside
it. Every restore is checked element by element against the saved values.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import unbroken
from common import (
    GIB,
    MIB,
    evict,
    free_port,
    hand_back,
    join_gloo,
    layout,
    leave_group,
    print_result,
    read_back,
    rotated,
    run_ranks,
    timed,
)
from limits import STREAMS, check_limits
from reshard_report import report
from s3_clients import Server, boto3_client, remove_bucket
from s3_servers import start_moto, start_rgw
from unbroken.format.coalesce import Extent, plan, rules_for
from unbroken.format.layout import Manifest
from unbroken.format.shards import overlap
from unbroken.storage.s3 import S3Options, S3Storage

SAVED_ON = 4
RESTORED_ON = (2, 1)
PIECE = 16 * MIB  # the limit's read size: unbroken's syscall size and S3 ranged-GET piece


@dataclass(frozen=True)
class Config:
    mib: int  # the whole state, all ranks together
    repeats: int
    dir: str
    io_threads: int
    server: Server | None

    @property
    def total_bytes(self) -> int:
        return self.mib * MIB


# --------------------------------------------------------------------------- the state


def rows_of(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``rank`` holds under ``Shard(0)`` (torch.chunk's split, as DTensor's)."""
    per = -(-rows // world)
    lo = min(rank * per, rows)
    return lo, min(lo + per, rows)


def values(index: int, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """The saved values of elements ``[lo, hi)`` (flat, global) of tensor ``index``."""
    flat = torch.arange(lo, hi, dtype=torch.int64)
    return ((flat * 2654435761 + index) % 65521 - 32760).to(dtype)


def sharded_state(mesh: DeviceMesh, total: int, fill: bool) -> dict[str, DTensor]:
    """The layout as DTensors sharded on dim 0 over ``mesh``; saved values or zeros."""
    rank, world = mesh.get_local_rank(), mesh.size()
    state = {}
    for index, (name, shape, dtype) in enumerate(layout(total)):
        lo, hi = rows_of(shape[0], world, rank)
        row = math.prod(shape[1:])
        local = (
            values(index, lo * row, hi * row, dtype)
            if fill
            else torch.zeros((hi - lo) * row, dtype=dtype)
        )
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        state[name] = DTensor.from_local(
            local.reshape(hi - lo, *shape[1:]), mesh, [Shard(0)], run_check=False,
            shape=torch.Size(shape), stride=stride,
        )  # fmt: skip
    return state


def check(state: dict[str, DTensor], total: int, what: str) -> None:
    """Raise unless every local shard holds the saved values."""
    for index, (name, shape, dtype) in enumerate(layout(total)):
        world, rank = state[name].device_mesh.size(), state[name].device_mesh.get_local_rank()
        lo, hi = rows_of(shape[0], world, rank)
        row = math.prod(shape[1:])
        if not torch.equal(
            state[name].to_local().reshape(-1), values(index, lo * row, hi * row, dtype)
        ):
            raise AssertionError(f"{what}: {name} differs from the saved values on rank {rank}")


# --------------------------------------------------------------------------- save (4 ranks)


def save_worker(rank: int, cfg: Config) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, SAVED_ON, cfg_port(cfg), timeout_s=600)
    state = {"model": sharded_state(init_device_mesh("cpu", (SAVED_ON,)), cfg.total_bytes, True)}
    with unbroken.Checkpointer(f"{cfg.dir}/unbroken") as ckpt:
        ckpt.save(1, state)
    if cfg.server is not None:
        with unbroken.Checkpointer(
            cfg.server.uri("reshard"), storage_options=cfg.server.options()
        ) as ckpt:
            ckpt.save(1, state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{cfg.dir}/dcp"))
    leave_group()


def cfg_port(cfg: Config) -> int:
    return int(Path(cfg.dir, "port").read_text())


# --------------------------------------------------------------------------- restore (M ranks)


def needed(manifest: Manifest, rank: int, world: int) -> list[tuple[str, int, int]]:
    """The byte ranges ``(file, start, end)`` of the checkpoint that hold this rank's
    shards under ``Shard(0)`` on ``world`` ranks, adjacent ones merged."""
    ranges = []
    for entry in manifest.tensors.values():
        shape = entry.shape
        lo, hi = rows_of(shape[0], world, rank)
        size = torch.empty((), dtype=entry.torch_dtype).element_size()
        for chunk in entry.chunks:
            region = overlap(
                [lo, *[0] * (len(shape) - 1)], [hi - lo, *shape[1:]], chunk.offsets, chunk.shape
            )
            if region is None:
                continue
            row = math.prod(chunk.shape[1:])
            first, last = (
                (region[0][0] - chunk.offsets[0]) * row,
                (region[0][1] - chunk.offsets[0]) * row,
            )
            ranges.append((chunk.file, chunk.start + first * size, chunk.start + last * size))
    merged: list[tuple[str, int, int]] = []
    for file, start, end in sorted(ranges):
        if merged and merged[-1][0] == file and merged[-1][2] == start:
            merged[-1] = (file, merged[-1][1], end)
        else:
            merged.append((file, start, end))
    return merged


def pieces(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int, int]]:
    """``(file, offset, length, where in the buffer)``: the ranges cut into ``PIECE`` reads."""
    out, at = [], 0
    for file, start, end in ranges:
        for offset in range(start, end, PIECE):
            n = min(PIECE, end - offset)
            out.append((file, offset, n, at))
            at += n
    return out


def requests(ranges: list[tuple[str, int, int]], storage: Any) -> list[tuple[str, int, int, int]]:
    """`pieces`, but cut into the ranged GETs unbroken's planner makes on ``storage``."""
    extents = [Extent(f"range {i}", *r) for i, r in enumerate(ranges)]
    total = sum(end - start for _, start, end in ranges)
    cut = plan(extents, rules_for(storage, total, S3Options().concurrency))
    out, at = [], 0
    for r in cut:
        out.append((r.file, r.start, r.end - r.start, at))
        at += r.end - r.start
    return out


class RestoreRank:
    """One rank of the restoring world: its empty shards and one method per way to fill them."""

    def __init__(self, rank: int, world: int, cfg: Config) -> None:
        self.rank, self.world, self.cfg = rank, world, cfg
        self.mesh = init_device_mesh("cpu", (world,))
        self.state = {"model": sharded_state(self.mesh, cfg.total_bytes, False)}
        self.samples: dict[str, list[float]] = {}
        self.residency: list[float] = []
        self.local = unbroken.Checkpointer(f"{cfg.dir}/unbroken")
        self.s3 = None
        if cfg.server is not None:
            self.s3 = unbroken.Checkpointer(
                cfg.server.uri("reshard"), storage_options=cfg.server.options()
            )
            self.store = S3Storage(
                cfg.server.uri("reshard"), S3Options(**cfg.server.options())
            ).store
        self.ranges = needed(self.local.manifest(1), rank, world)
        self.reads = pieces(self.ranges)
        # S3 requests may span the small gaps between ranges, as unbroken's do
        spans = [] if self.s3 is None else requests(self.ranges, self.s3.storage)
        need = max(sum(n for _, _, n, _ in reads) for reads in (self.reads, spans))
        self.scratch = torch.empty(need, dtype=torch.uint8)
        self.folder = "step-000000001"
        # the limits' threads, started once, as unbroken's IO workers are: a limit never
        # pays a thread start that unbroken does not
        self.local_pool = ThreadPoolExecutor(max(cfg.io_threads, STREAMS))
        self.s3_pool = ThreadPoolExecutor(S3Options().concurrency)

    def record(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(self.cfg.total_bytes / GIB / seconds)

    def cold(self) -> None:
        for t in self.state["model"].values():
            t.to_local().zero_()
        dist.barrier()
        if self.rank == 0:
            self.residency.append(evict(self.cfg.dir))
        dist.barrier()

    def limit_local(self) -> None:
        out = self.scratch.numpy().data
        folder = f"{self.cfg.dir}/unbroken/{self.folder}"

        def read() -> None:
            fds = {f: os.open(f"{folder}/{f}", os.O_RDONLY) for f in {p[0] for p in self.reads}}
            try:

                def one(p: tuple[str, int, int, int]) -> None:
                    file, offset, n, at = p
                    if os.preadv(fds[file], [out[at : at + n]], offset) != n:
                        raise EOFError(file)

                # at least unbroken's readers: a limit never has less parallelism
                list(self.local_pool.map(one, self.reads))
            finally:
                for fd in fds.values():
                    os.close(fd)

        self.cold()
        self.record("local limit", timed(read))

    def limit_s3(self) -> None:
        import obstore

        out = self.scratch.numpy().data

        def one(p: tuple[str, int, int, int]) -> None:
            file, offset, n, at = p
            out[at : at + n] = obstore.get_range(
                self.store, f"{self.folder}/{file}", start=offset, length=n
            )

        assert self.s3 is not None  # in unbroken's request size now, which it measures
        todo = requests(self.ranges, self.s3.storage)

        def read() -> None:
            list(self.s3_pool.map(one, todo))

        self.record("s3 limit", timed(read))

    def unbroken_local(self) -> None:
        self.cold()
        self.record("local unbroken", timed(lambda: self.local.restore(self.state)))
        check(self.state["model"], self.cfg.total_bytes, "unbroken, local")

    def unbroken_s3(self) -> None:
        assert self.s3 is not None
        self.cold()
        self.record("s3 unbroken", timed(lambda: self.s3.restore(self.state)))  # type: ignore[union-attr]
        check(self.state["model"], self.cfg.total_bytes, "unbroken, S3")

    def dcp_local(self) -> None:
        reader = dcp.FileSystemReader(f"{self.cfg.dir}/dcp")
        self.cold()
        self.record("local DCP", timed(lambda: dcp.load(self.state, storage_reader=reader)))
        check(self.state["model"], self.cfg.total_bytes, "DCP, local")

    def run(self) -> dict[str, Any]:
        methods = [self.limit_local, self.unbroken_local, self.dcp_local]
        if self.s3 is not None:
            methods += [self.limit_s3, self.unbroken_s3]
        for rep in range(self.cfg.repeats):
            for method in rotated(methods, rep):
                method()
        self.local.close()
        if self.s3 is not None:
            self.s3.close()
        self.local_pool.shutdown()
        self.s3_pool.shutdown()
        return {"samples": self.samples, "residency": max(self.residency, default=0.0)}


def restore_worker(rank: int, world: int, cfg: Config) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, world, cfg_port(cfg), timeout_s=600)
    result = RestoreRank(rank, world, cfg).run()
    hand_back(cfg.dir, result, f"restore-{world}.json")
    leave_group()


# --------------------------------------------------------------------------- main


def start_server(
    stack: contextlib.ExitStack, args: argparse.Namespace, workdir: str
) -> tuple[Server | None, str]:
    bucket = f"reshard-{uuid.uuid4().hex[:12]}"
    if args.server == "none":
        return None, "no S3"
    if args.server == "moto":
        server = Server("moto", start_moto(stack), "test", "test", bucket)
        note = "moto S3"
    else:
        rgw = start_rgw(stack, Path(workdir) / "rgw", max(4 * GIB, 3 * args.mib * MIB))
        server = Server("rgw", rgw.endpoint, rgw.access_key, rgw.secret_key, bucket, rgw.region)
        note = "Ceph RGW (memstore) S3"
    client = boto3_client(server)
    client.create_bucket(Bucket=server.bucket)
    stack.callback(remove_bucket, client, server.bucket)
    return server, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="the whole state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server", choices=("rgw", "moto", "none"), default="rgw")
    parser.add_argument("--io-threads", type=int, default=2, help="unbroken's, and the limit's")
    parser.add_argument("--dir", help="work directory on a real disk (default: under /tmp)")
    args = parser.parse_args()
    if args.mib < 16 or args.repeats < 1:
        parser.error("need --mib >= 16 and --repeats >= 1")
    workdir = tempfile.mkdtemp(prefix="unbroken-reshard-", dir=args.dir)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        server, note = start_server(stack, args, workdir)
        cfg = Config(args.mib, args.repeats, workdir, args.io_threads, server)
        Path(workdir, "port").write_text(str(free_port()))
        run_ranks(save_worker, (cfg,), SAVED_ON)
        runs = {}
        for world in RESTORED_ON:
            Path(workdir, "port").write_text(str(free_port()))
            run_ranks(restore_worker, (world, cfg), world)
            runs[world] = read_back(workdir, f"restore-{world}.json")
    title = f"{cfg.mib} MiB saved on {SAVED_ON} ranks (Shard(0)), {cfg.repeats} repeats, {note}"
    result = report(title, runs)
    print_result(
        result
        | {"mib": cfg.mib, "saved_on": SAVED_ON, "io_threads": cfg.io_threads, "server": note}
    )
    check_limits(result["fraction_of_limit"], "bench/reshard.py")


if __name__ == "__main__":
    main()
