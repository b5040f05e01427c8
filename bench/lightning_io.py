"""Lightning checkpoints: save and load times of one Trainer checkpoint through unbroken's
CheckpointIO and through s3torchconnector's S3LightningCheckpoint, on the same S3 server
(a Ceph RGW the bench starts on loopback), and through unbroken and Lightning's default
TorchCheckpointIO on local disk.

    python bench/lightning_io.py                                # 512 MiB of weights, RGW
    python bench/lightning_io.py --mib 4 --repeats 1 --server moto   # smoke, ~30 s

(Named lightning_io, not lightning: a file named lightning.py here would be imported in
place of the ``lightning`` package, which s3torchconnector imports.)

The checkpoint is what ``Trainer.save_checkpoint`` writes after one step of a model of
``--mib`` MiB of float32 weights under Adam (about 3x that in all: weights, two moments).
Every load is checked against the saved tensors (untimed). unbroken is timed saving in
the foreground, and saving with ``async_save=True``: the time until training may go on
("async, blocked") and until committed. Local loads read from the page cache (the files
were just written). s3torchconnector's writer fails on RGW 16.2 (empty ETag after a
multipart upload, see bench/s3.py): its save then reads n/a, and its load is timed on the
same bytes written by torch.save + boto3 (untimed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.io import TorchCheckpointIO
from torch import nn

from common import MIB, new_table, print_result, show
from s3_clients import REGION, Server, boto3_client, remove_bucket
from s3_servers import ceph_version, start_moto, start_rgw
from unbroken.lightning import CheckpointIO

Row = dict[str, Any]


class Wide(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def trainer_checkpoint(mib: int) -> dict[str, Any]:
    """What Trainer.save_checkpoint writes after one step of a ``mib`` MiB model."""
    width = 1024
    layers = max(1, mib * MIB // (4 * width * width))
    model = Wide(width, layers)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, width)))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)
    return trainer._checkpoint_connector.dump_checkpoint()


def same(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    for name, t in saved["state_dict"].items():
        if not torch.equal(loaded["state_dict"][name], t):
            raise AssertionError(f"loaded {name} differs from what was saved")
    moments = saved["optimizer_states"][0]["state"]
    for i, state in loaded["optimizer_states"][0]["state"].items():
        if not torch.equal(state["exp_avg"], moments[i]["exp_avg"]):
            raise AssertionError(f"loaded optimizer moment {i} differs")


def measure(plugin: Any, where: Callable[[int], str], ckpt: dict[str, Any], repeats: int) -> Row:
    """Median save and load seconds of ``plugin`` (``where(i)``: the path of repeat i)."""
    saves, loads = [], []
    for i in range(repeats):
        start = time.perf_counter()
        plugin.save_checkpoint(ckpt, where(i))
        saves.append(time.perf_counter() - start)
        loads.append(timed_load(plugin, where(i), ckpt))
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads)}


def timed_load(plugin: Any, path: str, ckpt: dict[str, Any]) -> float:
    """Seconds ``plugin`` takes to load ``path``, checked against ``ckpt`` (untimed)."""
    start = time.perf_counter()
    loaded = plugin.load_checkpoint(path)
    seconds = time.perf_counter() - start
    same(loaded, ckpt)
    return seconds


def measure_async(
    where: Callable[[int], str], ckpt: dict[str, Any], repeats: int, **kw: Any
) -> Row:
    """unbroken with async_save: seconds until save_checkpoint returns, and until committed."""
    plugin = CheckpointIO(async_save=True, **kw)
    blocked, committed = [], []
    for i in range(repeats):
        start = time.perf_counter()
        plugin.save_checkpoint(ckpt, where(i))
        blocked.append(time.perf_counter() - start)
        plugin.teardown()
        committed.append(time.perf_counter() - start)
    return {"blocked_s": statistics.median(blocked), "save_s": statistics.median(committed)}


def connector(server: Server, ckpt: dict[str, Any], repeats: int) -> Row:
    """s3torchconnector's S3LightningCheckpoint; its load on boto3-written bytes if its
    save fails."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.lightning import S3LightningCheckpoint

    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = (
        server.access_key,
        server.secret_key,
    )
    plugin = S3LightningCheckpoint(
        server.region, S3ClientConfig(force_path_style=True), endpoint=server.endpoint
    )
    try:
        return measure(plugin, lambda i: server.uri(f"s3tc/{i}.ckpt"), ckpt, repeats)
    except Exception as e:  # the CRT writer against RGW 16.2
        note = f"save failed: {type(e).__name__}: {str(e)[:120]}"
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    boto3_client(server).upload_fileobj(buffer, server.bucket, "s3tc/boto3.ckpt")
    path = server.uri("s3tc/boto3.ckpt")
    loads = [timed_load(plugin, path, ckpt) for _ in range(repeats)]
    note += "; load of torch.save + boto3 bytes"
    return {"save_s": None, "load_s": statistics.median(loads), "note": note}


def run(args: argparse.Namespace, server: Server, workdir: str) -> list[Row]:
    ckpt = trainer_checkpoint(args.mib)
    nbytes = sum(t.nbytes for t in _tensors(ckpt))
    opts = server.options()
    rows: list[Row] = []

    def add(method: str, storage: str, row: Row) -> None:
        rows.append({"method": method, "storage": storage, "bytes": nbytes} | row)
        print(f"{method} on {storage}: {row}", file=sys.stderr)

    uid = uuid.uuid4().hex[:6]

    def on_s3(name: str) -> Callable[[int], str]:
        return lambda i: server.uri(f"{name}-{uid}/{i}.ckpt")

    def on_disk(name: str) -> Callable[[int], str]:
        return lambda i: os.path.join(workdir, f"{name}-{i}.ckpt")

    n, s3 = args.repeats, server.kind
    add("unbroken", s3, measure(CheckpointIO(storage_options=opts), on_s3("ub"), ckpt, n))
    add("unbroken async", s3, measure_async(on_s3("uba"), ckpt, n, storage_options=opts))
    add("s3torchconnector", s3, connector(server, ckpt, n))
    add("unbroken", "local", measure(CheckpointIO(), on_disk("ub"), ckpt, n))
    add("unbroken async", "local", measure_async(on_disk("uba"), ckpt, n))
    add("TorchCheckpointIO", "local", measure(TorchCheckpointIO(), on_disk("torch"), ckpt, n))
    return rows


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def report(rows: list[Row], caption: str) -> None:
    columns = [("method", "left"), ("storage", "left"), ("save s", "right"),
               ("save GiB/s", "right"), ("async: blocked s", "right"), ("load s", "right"),
               ("load GiB/s", "right"), ("note", "left")]  # fmt: skip
    table = new_table("Lightning checkpoint save/load", caption, columns)  # type: ignore[arg-type]
    for r in rows:

        def rate(key: str, r: Row = r) -> str:
            return "n/a" if r.get(key) is None else f"{r['bytes'] / r[key] / 2**30:.2f}"

        def secs(key: str, r: Row = r) -> str:
            return "" if r.get(key) is None else f"{r[key]:.2f}"

        table.add_row(r["method"], r["storage"], secs("save_s"), rate("save_s"),
                      secs("blocked_s"), secs("load_s"), rate("load_s") if "load_s" in r else "",
                      r.get("note", ""))  # fmt: skip
    show(150, table)


def memstore(mib: int, repeats: int) -> int:
    """RAM for the RGW's OSD: every checkpoint the run writes (about 3x the weights each:
    2 unbroken rows x repeats, the connector's attempts and boto3's copy), capped at half
    of what this machine has free."""
    need = int(1.3 * (2 * repeats + 2) * 3 * mib * MIB) + (1 << 30)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(4 << 30, min(need, available // 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB of model weights")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server", choices=("rgw", "moto"), default="rgw")
    parser.add_argument("--workdir", default=None, help="local disk for the local rows")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="unbroken-lightning-bench-", dir=args.workdir)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        if args.server == "moto":
            server = Server("moto", start_moto(stack), "test", "test", bucket)
            where = "moto server (in the bench process)"
        else:
            rgw = start_rgw(stack, Path(workdir) / "rgw", memstore(args.mib, args.repeats))
            server = Server("rgw", rgw.endpoint, rgw.access_key, rgw.secret_key, bucket, REGION)
            where = f"Ceph RGW {ceph_version()} (memstore OSD, in RAM) on loopback"
        client = boto3_client(server)
        client.create_bucket(Bucket=bucket)
        stack.callback(remove_bucket, client, bucket)
        rows = run(args, server, workdir)
    caption = f"{args.mib} MiB model + Adam, median of {args.repeats}; S3: {where}"
    report(rows, caption)
    print_result({"mib": args.mib, "repeats": args.repeats, "server": args.server, "rows": rows})


if __name__ == "__main__":
    main()
