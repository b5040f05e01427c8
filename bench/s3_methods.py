"""The timed part of bench/s3.py: one rank's side of every method, on the server the
parent started."""

from __future__ import annotations

import io
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import unbroken
from common import (
    GIB,
    MIB,
    as_bytes,
    hand_back,
    join_gloo,
    leave_group,
    make_state,
    rotated,
    timed,
    verify,
)
from s3_clients import (
    Connector,
    FetchCounter,
    Server,
    boto3_client,
    collect_garbage,
    delete_prefix,
    reason_of,
    small_get_ms,
)
from unbroken.format.coalesce import rules_for
from unbroken.format.shards import FILE_BYTES
from unbroken.storage.s3 import S3Options, S3Storage, upload_parts

PART = 16 * MIB  # raw limit: multipart part size and ranged-GET piece, as unbroken's default
CONCURRENCY = 16  # raw limit: requests in flight, as unbroken's default
SMALL, SMALL_GETS = 4096, 8  # latency probe: this many ranged GETs of this size, one by one
Mode = Literal["each", "broadcast", "slice"]
MODES: tuple[Mode, ...] = ("each", "broadcast", "slice")


@dataclass(frozen=True)
class S3Config:
    """A run of bench/s3.py: ``ranks`` processes meeting at ``port``, each holding
    ``mib_per_rank`` MiB of its own and ``replicated_mib`` MiB that all ranks share, on
    ``server``; ``connector_missing`` says why the connector's rows are n/a."""

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


def replicated_state(total: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same tensors (keys and values) on every rank, like DDP parameters and
    optimizer state."""
    shard = make_state(0, total)["model"]
    return {"model": {k.replace("rank0.", "ddp.", 1): t for k, t in shard.items()}}


class S3Rank:
    """One rank's side of the benchmark."""

    def __init__(self, rank: int, cfg: S3Config) -> None:
        self.rank, self.cfg = rank, cfg
        server = cfg.server
        self.s3 = boto3_client(server)
        self.state = make_state(rank, cfg.mib_per_rank * MIB)
        self.tensors = list(self.state["model"].values())
        self.nbytes = sum(t.nbytes for t in self.tensors)
        # reference copy (never written again), touched before timing; the raw limit PUTs it
        self.reference = torch.cat([as_bytes(t) for t in self.tensors])
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
        self.requests: dict[str, dict[str, int]] = {}  # unbroken's last save and restore
        self.restored: list[int | None] = []  # what unbroken's last restore returned
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
        """Delete every object under ``prefix`` (rank 0), and have the server reclaim
        them, before the next clock starts."""
        if self.rank == 0:
            delete_prefix(client or self.s3, bucket or self.cfg.server.bucket, prefix)
            collect_garbage(self.cfg.server)
        dist.barrier()

    def all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        return int(flag.item()) == 0

    # -- methods ---------------------------------------------------------------------

    def raw_and_unbroken(self, rep: int) -> None:
        """The raw limit and unbroken back to back, who goes first alternating, each
        writing then reading on a server emptied before it (paired op by op, whichever
        wrote second met the other's bytes there and wrote slower): each of unbroken's
        samples has a raw one taken alike, which the report divides it by."""
        step = 1000 + rep
        raw_put, raw_get = self.raw_ops()
        raw = [raw_put, raw_get, self.small_gets, lambda: self.clear("raw/")]
        save, clear = (lambda: self.unbroken_save(step)), (lambda: self.clear("unbroken/"))
        ours = [save, self.unbroken_restore, clear]
        for op in ours + raw if rep % 2 else raw + ours:
            op()
        if self.restored != [step]:
            raise AssertionError(f"unbroken restore returned step {self.restored}, saved {step}")

    def small_gets(self) -> None:  # rank 0: the latency a small read pays (untimed)
        if self.rank == 0:
            self.small_get_ms += small_get_ms(self.raw_store, "rank0.0", SMALL, SMALL_GETS)

    def raw_ops(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """The raw PUT and the raw GET of this rank's bytes, each timed and recorded."""
        import obstore

        store, data = self.raw_store, self.reference.numpy().data
        # objects of at most FILE_BYTES, as unbroken splits a rank's data
        objects = [
            (f"rank{self.rank}.{i}", off, min(FILE_BYTES, self.nbytes - off))
            for i, off in enumerate(range(0, self.nbytes, FILE_BYTES))
        ]

        def put_one(obj: tuple[str, int, int]) -> None:
            key, off, n = obj
            count, part = upload_parts(n, PART)  # unbroken's parts for the same size
            # fed part by part, so the client copies each while earlier ones upload,
            # as it does unbroken's tensors (one buffer would be copied whole first)
            pieces = [data[off + s : off + min(s + part, n)] for s in range(0, n, part)]
            obstore.put(
                store,
                key,
                iter(pieces),
                use_multipart=count > 1,
                chunk_size=part,
                max_concurrency=CONCURRENCY,
            )

        out = self.scratch.numpy().data

        def pieces() -> list[tuple[str, int, int, int]]:  # in unbroken's GET size now
            length = rules_for(self.ckpt.storage, self.nbytes, CONCURRENCY).most
            return [
                (key, start, off + start, min(length, n - start))
                for key, off, n in objects
                for start in range(0, n, length)
            ]

        def get_one(piece: tuple[str, int, int, int]) -> None:
            key, start, at, n = piece
            out[at : at + n] = obstore.get_range(store, key, start=start, length=n)

        def put() -> None:
            with ThreadPoolExecutor(len(objects)) as threads:
                self.record("raw_put", timed(lambda: list(threads.map(put_one, objects))))

        def get() -> None:
            self.scratch.zero_()
            dist.barrier()
            todo = pieces()
            self.record("raw_get", timed(lambda: list(self.pool.map(get_one, todo))))
            if not torch.equal(self.scratch, self.reference):
                raise AssertionError("raw GET: data differs from what was PUT")

        return put, get

    def requests_so_far(self) -> Counter[str]:  # unbroken's HTTP requests here, by method
        return Counter(self.ckpt.storage.requests)  # type: ignore[attr-defined]

    def unbroken_save(self, step: int) -> None:
        before = self.requests_so_far()
        self.record("unbroken_save", timed(lambda: self.ckpt.save(step, self.state)))
        self.requests["save"] = self.all_requests(self.requests_so_far() - before)

    def unbroken_restore(self) -> None:
        self.zero(self.tensors)
        before = self.requests_so_far()
        self.restored = []
        self.record(
            "unbroken_restore", timed(lambda: self.restored.append(self.ckpt.restore(self.state)))
        )
        self.requests["restore"] = self.all_requests(self.requests_so_far() - before)
        verify(self.tensors, self.reference, "unbroken restore")

    def all_requests(self, mine: Counter[str]) -> dict[str, int]:
        """All ranks' ``mine``, summed by method."""
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dict(mine))
        return dict(sum((Counter(r) for r in everyone), Counter()))

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
        for mode in rotated(MODES, rep):
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
        self.raw_and_unbroken(-1)  # warm-up, untimed: the server's and clients' first use
        self.samples.clear()
        self.small_get_ms.clear()
        methods: list[Callable[[int], None]] = [
            self.raw_and_unbroken,
            self.torch_boto3,
            self.connector_dcp,
            self.replicated_modes,
        ]
        for rep in range(self.cfg.repeats):
            for method in rotated(methods, rep):  # each method runs in each slot over time
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
            "requests": self.requests,
        }

    def close(self) -> None:
        for ckpt in [self.ckpt, *self.rep_ckpts.values()]:
            ckpt.close()
        self.pool.shutdown()


def worker(rank: int, cfg: S3Config) -> None:
    torch.set_num_threads(1)
    # the connector's native client reads its credentials from the environment only
    os.environ["AWS_ACCESS_KEY_ID"] = cfg.server.access_key
    os.environ["AWS_SECRET_ACCESS_KEY"] = cfg.server.secret_key
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    logging.getLogger("s3torchconnector").setLevel(logging.CRITICAL)  # its retry chatter
    join_gloo(rank, cfg.ranks, cfg.port, timeout_s=300)
    bench = S3Rank(rank, cfg)
    hand_back(cfg.workdir, bench.run())
    bench.close()
    leave_group()
