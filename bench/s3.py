# mypy: disallow-untyped-defs
"""Save/restore throughput on S3 object storage: unbroken against ``torch.save`` + boto3 and
the S3 connector for PyTorch's DCP writer and reader, next to the raw limit of the client
unbroken uses (obstore), plus unbroken's restore read modes on a replicated (DDP-like) state,
all measured in one run.

    python bench/s3.py                        # Ceph RGW, 2 ranks x 256 MiB, 3 repeats
    python bench/s3.py --mib-per-rank 16 --repeats 1 --server moto    # smoke, under 40 s
    python bench/s3.py --endpoint http://host:port --access-key K --secret-key S   # yours

The server is a Ceph RGW started by the bench on loopback (tests/servers/rgw.py: one monitor,
one in-memory OSD, radosgw), or moto's S3 server in this process (``--server moto``), or an
existing one (``--endpoint``). Each rank is a real process in a gloo group and holds a
different shard (per-rank keys and data, as in bench/save_load.py), so every method moves
ranks x MiB. Throughput is aggregate: the bytes of all ranks / wall time of the slowest rank,
clocks started after a barrier. Methods are interleaved (order rotates each repeat); objects
are deleted after each method (the OSD keeps everything in RAM). Best and median of the
repeats are reported. Every restore is compared with the saved bytes; a mismatch aborts.

Methods:

- unbroken: ``Checkpointer("s3://bucket/unbroken")``, default options (16 MiB parts, 16
  requests in flight per object) but endpoint, credentials and path-style addressing;
- raw limit: each rank PUTs its bytes with ``obstore.put`` (16 MiB parts, 16 in flight) and
  reads them back with 16 parallel ``get_range`` calls into a preallocated buffer: the same
  client and client settings as unbroken, without its format, checksums or coordination;
- ``torch.save`` into a BytesIO, ``upload_fileobj`` (boto3's default TransferConfig:
  multipart, 10 threads); ``download_fileobj`` + ``torch.load(weights_only=True)`` + copy
  into the live tensors;
- the S3 connector for PyTorch (s3torchconnector) as DCP storage writer and reader. Its writer
  is tried on the bench's server first, then on moto. Observed with s3torchconnector 1.5.0:
  every upload ends with 'Header "ETag" not found' on both, because the CRT takes the ETag
  from the CompleteMultipartUpload reply, which RGW 16.2 sends empty and moto 5.2 wraps in a
  root element the CRT does not look for. The save is then n/a, and the reader is measured on
  a checkpoint of the same format written by DCP's FileSystemWriter and uploaded with boto3
  (untimed).

Replicated state (every rank holds the same tensors, as under DDP): unbroken stores it once;
it is restored with ``replicated_reads="each"``, ``"broadcast"`` and ``"slice"``, reporting
GiB/s of the bytes all ranks end up holding and the bytes fetched from storage (counted at
unbroken's storage layer).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import unbroken
from save_load import GIB, MIB, as_bytes, flat_views, free_port, make_state, timed, verify
from unbroken.shards import FILE_BYTES
from unbroken.storage.s3 import S3Options, S3Storage

REPO = Path(__file__).resolve().parent.parent
REGION = "us-east-1"
PART = 16 * MIB  # raw limit: multipart part size and ranged-GET piece, as unbroken's default
CONCURRENCY = 16  # raw limit: requests in flight, as unbroken's default
SMALL, SMALL_GETS = 4096, 8  # latency probe: this many ranged GETs of this size, one by one
TARGET_OF_LIMIT = 0.9  # unbroken save/restore, as a fraction of raw PUT/GET
TARGET_VS_BOTO3 = 1.4  # ... and as a multiple of torch.save + boto3
Mode = Literal["each", "broadcast", "slice"]
MODES: tuple[Mode, ...] = ("each", "broadcast", "slice")
CONNECTOR = "s3torchconnector"
NO_CONNECTOR = (
    "s3torchconnector is not installed: pip install 's3torchconnector[dcp]' "
    "(its DCP module also needs tenacity, from the [dcp] extra)"
)


@dataclass(frozen=True)
class Server:
    kind: str  # "rgw", "moto" or "external"
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = REGION

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def options(self) -> dict[str, Any]:
        """unbroken's storage options: its defaults, but where and who."""
        return {
            "endpoint": self.endpoint,
            "region": self.region,
            "path_style": True,
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
        }


@dataclass(frozen=True)
class Config:
    ranks: int
    mib_per_rank: int
    replicated_mib: int
    repeats: int
    port: int
    workdir: str
    server: Server
    moto: Server | None  # where the connector's writer goes if ``server`` rejects it
    connector_missing: str | None

    @property
    def total_bytes(self) -> int:
        return self.ranks * self.mib_per_rank * MIB

    @property
    def replicated_bytes(self) -> int:
        return self.replicated_mib * MIB


# --------------------------------------------------------------------------- clients


def boto3_client(server: Server) -> Any:
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name=server.region,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=BotoConfig(s3={"addressing_style": "path"}),
    )


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            reply = client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            if reply.get("Errors"):
                raise RuntimeError(f"deleting s3://{bucket}/{prefix}: {reply['Errors'][:3]}")


def replicated_state(total: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same tensors (keys and values) on every rank, like DDP parameters and
    optimizer state."""
    shard = make_state(0, total)["model"]
    return {"model": {k.replace("rank0.", "ddp.", 1): t for k, t in shard.items()}}


class FetchCounter:
    """Counts the bytes a checkpointer's storage fetches (GETs), from every thread."""

    def __init__(self, storage: Any) -> None:
        self.bytes = 0
        self._lock = threading.Lock()
        read_into, read = storage.read_into, storage.read

        def counted_read_into(path: str, offset: int, out: memoryview) -> None:
            read_into(path, offset, out)
            self.add(out.nbytes)

        def counted_read(path: str) -> bytes:
            data: bytes = read(path)
            self.add(len(data))
            return data

        storage.read_into, storage.read = counted_read_into, counted_read

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


def reason_of(error: BaseException) -> str:
    """One line saying why a DCP call failed (DCP wraps each rank's exception)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    text = f"{type(error).__name__}: {error}"
    return re.sub(r"\s+", " ", text)[:300]


# --------------------------------------------------------------------------- connector


class Connector:
    """The S3 connector for PyTorch as DCP storage writer and reader, on one server.

    Its writer and reader take no endpoint; their file system (``S3FileSystem``) takes an
    ``s3_client``, and the connector's ``S3Client`` takes ``endpoint``: so each writer and
    reader gets a file system around one shared client that points at ``server``."""

    def __init__(self, server: Server) -> None:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        self.server = server
        self.config = S3ClientConfig(force_path_style=True)
        self.client = S3Client(server.region, endpoint=server.endpoint, s3client_config=self.config)

    def writer(self, prefix: str) -> Any:
        from s3torchconnector.dcp import S3StorageWriter
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        writer: Any = S3StorageWriter(
            self.server.region, self.server.uri(prefix), s3client_config=self.config
        )
        writer.fs = S3FileSystem(self.server.region, s3_client=self.client)
        return writer

    def reader(self, prefix: str) -> Any:
        from s3torchconnector.dcp import S3StorageReader
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        reader: Any = S3StorageReader(
            self.server.region, self.server.uri(prefix), s3client_config=self.config
        )
        reader.fs = S3FileSystem(
            self.server.region,
            s3_client=self.client,
            reader_constructor=reader._reader_constructor,  # per reader: it holds the plan
        )
        return reader


# --------------------------------------------------------------------------- worker


class Rank:
    """One rank's side of the benchmark."""

    def __init__(self, rank: int, cfg: Config) -> None:
        self.rank, self.cfg = rank, cfg
        server = cfg.server
        self.s3 = boto3_client(server)
        self.state = make_state(rank, cfg.mib_per_rank * MIB)
        self.tensors = list(self.state["model"].values())
        self.nbytes = sum(t.nbytes for t in self.tensors)
        # reference copy (never written again), touched before timing; the raw limit PUTs it
        self.reference = torch.empty(self.nbytes, dtype=torch.uint8)
        for t, view in zip(self.tensors, flat_views(self.reference, self.tensors), strict=True):
            view.copy_(as_bytes(t))
        self.scratch = torch.zeros(self.nbytes, dtype=torch.uint8)  # the raw GETs land here
        self.replicated = replicated_state(cfg.replicated_bytes)
        self.rep_tensors = list(self.replicated["model"].values())
        self.rep_reference = torch.cat([as_bytes(t) for t in self.rep_tensors])

        # the raw limit borrows unbroken's obstore client (same settings), nothing else
        self.raw_store = S3Storage(server.uri("raw"), S3Options(**server.options())).store
        self.pool = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="raw-get")
        self.ckpt = unbroken.Checkpointer(  # collective, as are the ones below
            server.uri("unbroken"), storage_options=server.options()
        )
        self.rep_ckpts = {
            mode: unbroken.Checkpointer(
                server.uri("replicated"), storage_options=server.options(), replicated_reads=mode
            )
            for mode in MODES
        }
        self.fetched = {mode: FetchCounter(c.storage) for mode, c in self.rep_ckpts.items()}

        self.samples: dict[str, list[float]] = {}
        self.fetched_bytes: dict[str, list[int]] = {}
        self.small_get_ms: list[float] = []
        self.connector: dict[str, Any] = {}  # where the connector runs, or why not
        self.dcp: Connector | None = None  # the one the connector rows use
        self.dcp_s3 = self.s3  # a boto3 client on the same server, to delete its objects

    # -- helpers ---------------------------------------------------------------------

    def record(self, name: str, seconds: float, nbytes: int | None = None) -> None:
        total = self.cfg.total_bytes if nbytes is None else nbytes
        self.samples.setdefault(name, []).append(total / GIB / seconds)

    def zero(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:  # a restore that writes nothing must fail verification
            t.zero_()
        dist.barrier()

    def clear(self, prefix: str, client: Any = None, bucket: str | None = None) -> None:
        """Delete every object under ``prefix`` (rank 0) before the next clock starts."""
        if self.rank == 0:
            delete_prefix(client or self.s3, bucket or self.cfg.server.bucket, prefix)
        dist.barrier()

    def all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        return int(flag.item()) == 0

    # -- methods ---------------------------------------------------------------------

    def raw_limit(self, rep: int) -> None:
        import obstore

        store, data = self.raw_store, self.reference.numpy().data
        # objects of at most FILE_BYTES, as unbroken splits a rank's data
        objects = [
            (f"rank{self.rank}.{i}", off, min(FILE_BYTES, self.nbytes - off))
            for i, off in enumerate(range(0, self.nbytes, FILE_BYTES))
        ]

        def put() -> None:
            def one(obj: tuple[str, int, int]) -> None:
                key, off, n = obj
                obstore.put(
                    store,
                    key,
                    data[off : off + n],
                    use_multipart=n > PART,
                    chunk_size=PART,
                    max_concurrency=CONCURRENCY,
                )

            with ThreadPoolExecutor(len(objects)) as threads:
                list(threads.map(one, objects))

        out = self.scratch.numpy().data
        pieces = [  # (key, start in the object, start in the rank's bytes, length)
            (key, start, off + start, min(PART, n - start))
            for key, off, n in objects
            for start in range(0, n, PART)
        ]

        def get() -> None:
            def one(piece: tuple[str, int, int, int]) -> None:
                key, start, at, n = piece
                out[at : at + n] = obstore.get_range(store, key, start=start, length=n)

            list(self.pool.map(one, pieces))

        self.record("raw_put", timed(put))
        self.scratch.zero_()
        dist.barrier()
        self.record("raw_get", timed(get))
        if not torch.equal(self.scratch, self.reference):
            raise AssertionError("raw GET: data differs from what was PUT")
        if self.rank == 0:  # the latency a small read pays (untimed, one at a time)
            for i in range(SMALL_GETS):
                start = time.perf_counter()
                obstore.get_range(store, objects[0][0], start=i * SMALL, length=SMALL)
                self.small_get_ms.append((time.perf_counter() - start) * 1000)
        self.clear("raw/")

    def unbroken_ckpt(self, rep: int) -> None:
        step = 1000 + rep
        self.record("unbroken_save", timed(lambda: self.ckpt.save(step, self.state)))
        self.zero(self.tensors)
        got: list[int | None] = []
        self.record("unbroken_restore", timed(lambda: got.append(self.ckpt.restore(self.state))))
        if got != [step]:
            raise AssertionError(f"unbroken restore returned step {got}, saved {step}")
        verify(self.tensors, self.reference, "unbroken restore")
        self.clear("unbroken/")

    def torch_boto3(self, rep: int) -> None:
        key = f"torch/{rep}/rank{self.rank}.pt"
        bucket = self.cfg.server.bucket

        def save() -> None:
            buf = io.BytesIO()
            torch.save(self.state, buf)
            buf.seek(0)
            self.s3.upload_fileobj(buf, bucket, key)

        def load() -> None:
            buf = io.BytesIO()
            self.s3.download_fileobj(bucket, key, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=True)["model"]
            for t, src in zip(self.tensors, loaded.values(), strict=True):
                t.copy_(src)  # what load_state_dict does

        self.record("boto3_save", timed(save))
        self.zero(self.tensors)
        self.record("boto3_restore", timed(load))
        verify(self.tensors, self.reference, "torch.load")
        self.clear("torch/")

    def setup_connector(self) -> None:
        """Find a server the connector's DCP writer works on; failing that, store a
        checkpoint of the same format for its reader (written by DCP's FileSystemWriter,
        uploaded with boto3, untimed)."""
        cfg, info = self.cfg, self.connector
        info.update(save_on=None, restore_on=None, errors={}, restore_source=None)
        if cfg.connector_missing:
            info["errors"]["install"] = cfg.connector_missing
            return
        tried = {}
        for server in (cfg.server, cfg.moto):
            if server is None:
                continue
            connector = tried[server.kind] = Connector(server)
            probe = {"probe": {f"rank{self.rank}": torch.arange(4096, dtype=torch.float32)}}
            error = ""
            try:
                dcp.save(probe, storage_writer=connector.writer("dcp-probe"))
            except (Exception, CheckpointException) as e:
                error = reason_of(e)
            ok = self.all_agree(not error)
            client = boto3_client(server)
            self.clear("dcp-probe/", client, server.bucket)
            if ok:
                info.update(save_on=server.kind, restore_on=server.kind)
                self.dcp, self.dcp_s3 = connector, client
                return
            info["errors"][server.kind] = error or "failed on another rank"
        # no server takes the writer: store the checkpoint the reader will read
        local = Path(cfg.workdir) / "dcp-local"
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(str(local)))
        dist.barrier()
        if self.rank == 0:
            for path in sorted(local.iterdir()):
                self.s3.upload_file(str(path), cfg.server.bucket, f"dcp/fixed/{path.name}")
            shutil.rmtree(local)
        dist.barrier()
        info.update(restore_on=cfg.server.kind, restore_source="FileSystemWriter + boto3")
        self.dcp = tried[cfg.server.kind]  # its native client is built (by the probe)

    def connector_dcp(self, rep: int) -> None:
        info, connector = self.connector, self.dcp
        if connector is None:
            return
        prefix = "dcp/fixed"
        if info["save_on"] is not None:
            prefix = f"dcp/{rep}"
            writer = connector.writer(prefix)
            self.record("dcp_save", timed(lambda: dcp.save(self.state, storage_writer=writer)))
        self.zero(self.tensors)
        reader = connector.reader(prefix)
        self.record("dcp_restore", timed(lambda: dcp.load(self.state, storage_reader=reader)))
        verify(self.tensors, self.reference, "s3torchconnector DCP load")
        if info["save_on"] is not None:
            self.clear(f"{prefix}/", self.dcp_s3, connector.server.bucket)

    def replicated_modes(self, rep: int) -> None:
        step = 2000 + rep
        stored = self.cfg.replicated_bytes
        held = self.cfg.ranks * stored
        saver = self.rep_ckpts["each"]
        self.record("replicated_save", timed(lambda: saver.save(step, self.replicated)), stored)
        shift = rep % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            ckpt, counter = self.rep_ckpts[mode], self.fetched[mode]
            self.zero(self.rep_tensors)
            counter.bytes = 0
            got: list[int | None] = []
            seconds = timed(lambda: got.append(ckpt.restore(self.replicated)))  # noqa: B023
            self.record(f"replicated_restore_{mode}", seconds, held)
            if got != [step]:
                raise AssertionError(f"restore ({mode}) returned step {got}, saved {step}")
            verify(self.rep_tensors, self.rep_reference, f"replicated restore ({mode})")
            fetched = torch.tensor([counter.bytes], dtype=torch.int64)
            dist.all_reduce(fetched)
            self.fetched_bytes.setdefault(mode, []).append(int(fetched.item()))
        self.clear("replicated/")

    # -- run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.setup_connector()
        methods: list[Callable[[int], None]] = [
            self.raw_limit,
            self.unbroken_ckpt,
            self.torch_boto3,
            self.connector_dcp,
            self.replicated_modes,
        ]
        for rep in range(self.cfg.repeats):
            shift = rep % len(methods)  # interleave: each method runs in each slot over time
            for method in methods[shift:] + methods[:shift]:
                method(rep)
            if self.rank == 0:
                done = ", ".join(f"{k} {v[-1]:.2f}" for k, v in self.samples.items())
                print(f"repeat {rep + 1}/{self.cfg.repeats} (GiB/s): {done}", flush=True)
        self.clear("dcp/")
        return {
            "samples": self.samples,
            "fetched_bytes": self.fetched_bytes,
            "small_get_ms": self.small_get_ms,
            "connector": self.connector,
        }

    def close(self) -> None:
        for ckpt in [self.ckpt, *self.rep_ckpts.values()]:
            ckpt.close()
        self.pool.shutdown()


def worker(rank: int, cfg: Config) -> None:
    torch.set_num_threads(1)
    # the connector's native client reads its credentials from the environment only
    os.environ["AWS_ACCESS_KEY_ID"] = cfg.server.access_key
    os.environ["AWS_SECRET_ACCESS_KEY"] = cfg.server.secret_key
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    logging.getLogger("s3torchconnector").setLevel(logging.CRITICAL)  # its retry chatter
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg.port}",
        rank=rank,
        world_size=cfg.ranks,
        timeout=timedelta(seconds=300),
    )
    bench = Rank(rank, cfg)
    out = bench.run()
    if rank == 0:
        (Path(cfg.workdir) / "result.json").write_text(json.dumps(out))
    bench.close()
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- report


def fmt(x: float) -> str:
    return f"{x:.2f}"


def row(*cells: str, fetched: str = "", target: str = "") -> tuple[str, ...]:
    """A table row: method, op, GiB/s, median, of raw, vs boto3 (the missing ones blank),
    fetched, target."""
    return (*cells, *[""] * (6 - len(cells)), fetched, target)


def report(
    cfg: Config, raw: dict[str, Any], server_note: str, others: dict[str, float]
) -> dict[str, Any]:
    samples: dict[str, list[float]] = raw["samples"]
    best = {k: max(v) for k, v in samples.items()}
    median = {k: statistics.median(v) for k, v in samples.items()}
    connector = raw["connector"]
    limit = {"save": best["raw_put"], "restore": best["raw_get"]}
    rows: list[tuple[str, ...]] = []
    fraction: dict[str, float] = {}
    vs_boto3: dict[str, float] = {}
    passed: dict[str, bool] = {}

    small_get_ms = statistics.median(raw["small_get_ms"])
    put = fmt(best["raw_put"]), fmt(median["raw_put"])
    rows.append(row("limit: obstore, parallel", "PUT", *put))
    latency = f"one {SMALL // 1024} KiB GET: {small_get_ms:.1f} ms (median)"
    rows.append(row("", "GET", fmt(best["raw_get"]), fmt(median["raw_get"]), target=latency))

    dcp_label = "s3torchconnector DCP"
    if connector.get("save_on") not in (None, cfg.server.kind):
        dcp_label += f" (on {connector['save_on']})"
    methods = [
        ("unbroken", "unbroken"),
        ("torch.save + boto3", "boto3"),
        (dcp_label, "dcp"),
    ]
    for label, name in methods:
        for i, op in enumerate(("save", "restore")):
            key = f"{name}_{op}"
            note = ""
            if key not in best:
                why = connector["errors"]
                note = "; ".join(f"{where}: {text}" for where, text in why.items())
                rows.append(row(label if i == 0 else "", op, "n/a", "n/a", target=note))
                continue
            fraction[key] = best[key] / limit[op]
            if "boto3_" + op in best:
                vs_boto3[key] = best[key] / best["boto3_" + op]
            if name == "unbroken":
                ok = fraction[key] >= TARGET_OF_LIMIT and vs_boto3[key] >= TARGET_VS_BOTO3
                passed[key] = ok
                note = (
                    f"{'PASS' if ok else 'FAIL'}: {fraction[key]:.0%} of raw (need "
                    f"{TARGET_OF_LIMIT:.0%}), {vs_boto3[key]:.2f}x boto3 "
                    f"(need {TARGET_VS_BOTO3:g}x)"
                )
            elif name == "dcp" and op == "restore" and connector.get("restore_source"):
                note = f"checkpoint written by DCP {connector['restore_source']} (untimed)"
            elif name == "dcp" and connector["errors"]:
                note = "; ".join(f"{w}: {t}" for w, t in connector["errors"].items())
            ratio = f"{vs_boto3[key]:.2f}x" if key in vs_boto3 else ""
            figures = fmt(best[key]), fmt(median[key]), f"{fraction[key]:.0%}", ratio
            rows.append(row(label if i == 0 else "", op, *figures, target=note))

    fetched: dict[str, int] = {}
    stored = cfg.replicated_bytes
    label = f"unbroken, replicated {cfg.replicated_mib} MiB"
    saved = fmt(best["replicated_save"]), fmt(median["replicated_save"])
    rows.append(row(label, "save (stored once)", *saved))
    for mode in MODES:
        key = f"replicated_restore_{mode}"
        counts = raw["fetched_bytes"][mode]
        fetched[mode] = max(counts)
        times = fetched[mode] / stored
        got = f"{fetched[mode] / MIB:,.0f} MiB ({times:.2f}x)"
        rows.append(row("", f"restore, {mode}", fmt(best[key]), fmt(median[key]), fetched=got))

    print_table(cfg, rows, server_note, others)
    return {
        "config": public(asdict(cfg)) | {"total_bytes": cfg.total_bytes},
        "server": server_note,
        "statistic": "best of repeats",
        "gib_per_s": best,
        "median_gib_per_s": median,
        "samples": samples,
        "limits": limit,
        "small_get_ms": {"bytes": SMALL, "median": small_get_ms, "samples": raw["small_get_ms"]},
        "fraction_of_limit": fraction,
        "vs_boto3": vs_boto3,
        "median_fraction_of_limit": {
            k: median[k] / median["raw_put" if k.endswith("save") else "raw_get"] for k in fraction
        },
        "targets": {"of_limit": TARGET_OF_LIMIT, "vs_boto3": TARGET_VS_BOTO3},
        "passed": passed,
        "connector": connector,
        "versions": versions(),
        "other_processes_cpu": others,
        "replicated": {
            "stored_bytes": stored,
            "held_bytes": cfg.ranks * stored,
            "fetched_bytes": fetched,
            "fetched_per_stored": {m: b / stored for m, b in fetched.items()},
        },
    }


def public(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without credentials (a server of the user's may be behind them)."""
    for server in (config["server"], config["moto"]):
        if server is not None:
            server["access_key"] = server["secret_key"] = "***"
    return config


def print_table(
    cfg: Config, rows: list[tuple[str, ...]], server_note: str, others: dict[str, float]
) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=f"S3: {cfg.ranks} ranks x {cfg.mib_per_rank} MiB, {cfg.repeats} repeats, "
        f"{server_note}",
        caption="aggregate GiB/s (all ranks' bytes / slowest rank), best and median of repeats; "
        "'of raw' = % of obstore PUT (saves) or GET (restores); replicated restores: GiB/s of "
        "the bytes all ranks hold, 'fetched' = bytes GET from storage (x the stored size)"
        + (
            f"; the server runs on this {os.cpu_count()}-core VM and shares its CPUs with the ranks"
            if cfg.server.kind != "external"
            else ""
        )
        + f"; other processes{' (the server among them)' if cfg.server.kind == 'external' else ''}"
        f" took {others['cores']:.2f} cores on average during the run",
    )
    for name, justify in [
        ("method", "left"),
        ("op", "left"),
        ("GiB/s", "right"),
        ("median", "right"),
        ("of raw", "right"),
        ("vs boto3", "right"),
        ("fetched", "right"),
        ("target", "left"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*map(escape, row))  # error texts may hold [brackets]
    Console(width=160).print(table)


# --------------------------------------------------------------------------- main


class CpuAudit:
    """CPU seconds that processes other than the bench's took while it ran: the machine's
    busy time (/proc/stat) minus this process's (moto runs in it), its children's (the
    ranks, once joined) and the RGW daemons'. A large figure means the run competed with
    someone else's work on this shared VM."""

    def __init__(self, daemons: list[int]) -> None:
        self.daemons = daemons
        self.started = time.monotonic()
        self.start = self.snapshot()

    def snapshot(self) -> tuple[float, float]:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:  # user nice system idle iowait irq softirq
            user, nice, system, _, _, irq, softirq = (int(x) for x in f.readline().split()[1:8])
        t = os.times()
        ours = t.user + t.system + t.children_user + t.children_system
        for pid in self.daemons:
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ours += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        # (interrupt time is charged to the process that was running: count it on both sides)
        return (user + nice + system + irq + softirq) / tick, ours

    def others(self) -> dict[str, float]:
        busy, ours = self.snapshot()
        wall = time.monotonic() - self.started
        other = max(0.0, (busy - self.start[0]) - (ours - self.start[1]))
        return {"cpu_s": other, "wall_s": wall, "cores": other / wall}


def daemon_pids(directory: Path) -> list[int]:
    pids = []
    for path in (directory / "run").glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(path.read_text()))
    return pids


def start_moto(stack: contextlib.ExitStack) -> str:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    stack.callback(server.stop)
    return f"http://127.0.0.1:{port}"


def start_rgw(stack: contextlib.ExitStack, directory: Path, memstore: int) -> Any:
    sys.path.insert(0, str(REPO / "tests"))
    from servers.rgw import RGWUnavailable, start_rgw

    # the OSD keeps every object in RAM, up to this many bytes
    os.environ.setdefault("RGW_MEMSTORE_BYTES", str(memstore))
    try:
        rgw = start_rgw(directory)
    except RGWUnavailable as e:
        raise SystemExit(
            f"Ceph RGW could not start: {e.reason}\n(run with --server moto, or --endpoint "
            "for a server of your own)"
        ) from None
    stack.callback(rgw.stop)
    return rgw


def memstore_bytes(cfg_total: int, replicated: int, repeats: int) -> int:
    """Room for every object the run writes (deleted objects are reclaimed only by RGW's
    garbage collection, every 30 s or so), capped by what this machine can spare."""
    need = int(1.3 * (repeats * (4 * cfg_total + replicated) + cfg_total)) + GIB
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    ranks_need = 4 * cfg_total + 3 * replicated
    return max(4 * GIB, min(need, (available - ranks_need) // 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--replicated-mib", type=int, help="default: --mib-per-rank")
    parser.add_argument("--repeats", type=int, default=3, help="best and median are reported")
    parser.add_argument("--server", choices=("rgw", "moto"), default="rgw")
    parser.add_argument("--endpoint", help="an existing S3 server instead (http://host:port)")
    parser.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID"))
    parser.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    parser.add_argument("--region", default=REGION)
    args = parser.parse_args()
    replicated_mib = args.replicated_mib or args.mib_per_rank
    if min(args.mib_per_rank, replicated_mib) < 16 or args.ranks < 1 or args.repeats < 1:
        parser.error("need --mib-per-rank, --replicated-mib >= 16, --ranks >= 1, --repeats >= 1")
    if args.endpoint and not (args.access_key and args.secret_key):
        parser.error("--endpoint needs --access-key and --secret-key (or AWS_* variables)")

    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(
            f"note: load average {load:.1f} before the run: figures will be noisy", file=sys.stderr
        )
    missing = None
    if not all(importlib.util.find_spec(m) for m in (CONNECTOR, "tenacity")):
        missing = NO_CONNECTOR
        print(f"note: {missing}; its row will read n/a", file=sys.stderr)

    workdir = tempfile.mkdtemp(prefix="unbroken-s3-bench-")
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    total = args.ranks * args.mib_per_rank * MIB
    daemons: list[int] = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        if args.endpoint:
            server = Server(
                "external", args.endpoint, args.access_key, args.secret_key, bucket, args.region
            )
            note = f"S3 at {args.endpoint}"
        elif args.server == "moto":
            server = Server("moto", start_moto(stack), "test", "test", bucket)
            note = "moto server (in the bench process)"
        else:
            started = time.perf_counter()
            memstore = memstore_bytes(total, replicated_mib * MIB, args.repeats)
            rgw = start_rgw(stack, Path(workdir) / "rgw", memstore)
            daemons = daemon_pids(rgw.directory)
            print(f"Ceph RGW up in {time.perf_counter() - started:.1f} s", file=sys.stderr)
            server = Server("rgw", rgw.endpoint, rgw.access_key, rgw.secret_key, bucket, rgw.region)
            note = f"Ceph RGW {ceph_version()} (memstore OSD, in RAM) on loopback"
        moto = None
        if server.kind != "moto" and missing is None:
            # where the connector's writer goes if the server rejects it (RGW 16.2 does)
            moto = replace(server, kind="moto", endpoint=start_moto(stack))
        for s in (server, moto):
            if s is not None:
                client = boto3_client(s)
                client.create_bucket(Bucket=s.bucket)
                stack.callback(remove_bucket, client, s.bucket)

        cfg = Config(
            args.ranks,
            args.mib_per_rank,
            replicated_mib,
            args.repeats,
            free_port(),
            workdir,
            server,
            moto,
            missing,
        )
        audit = CpuAudit(daemons)
        mp.spawn(worker, args=(cfg,), nprocs=cfg.ranks, join=True)
        others = audit.others()
        raw = json.loads((Path(workdir) / "result.json").read_text())
    result = report(cfg, raw, note, others) | {"load_average_before": load}
    print("RESULT " + json.dumps(result, separators=(",", ":")))


def ceph_version() -> str:
    try:
        out = subprocess.run(["radosgw", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "?"
    found = re.search(r"ceph version (\S+)", out)
    return found.group(1) if found else "?"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "obstore", "boto3", "s3torchconnector", "moto"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def remove_bucket(client: Any, bucket: str) -> None:
    with contextlib.suppress(Exception):  # the server may be gone already
        delete_prefix(client, bucket, "")
        client.delete_bucket(Bucket=bucket)


if __name__ == "__main__":
    main()
