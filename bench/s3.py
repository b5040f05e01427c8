# mypy: disallow-untyped-defs
"""Save/restore throughput on S3 object storage: unbroken against ``torch.save`` + boto3 and
the S3 connector for PyTorch's DCP writer and reader, next to the raw limit of the client
unbroken uses (obstore), plus unbroken's restore read modes on a replicated (DDP-like) state,
all measured in one run.

    python bench/s3.py                        # Ceph RGW, 2 ranks x 256 MiB, 7 repeats
    python bench/s3.py --mib-per-rank 16 --repeats 1 --server moto    # smoke, under 40 s
    python bench/s3.py --endpoint http://host:port --access-key K --secret-key S   # yours

The server is a Ceph RGW started by the bench on loopback (tests/servers/rgw.py: one monitor,
one in-memory OSD, radosgw), or moto's S3 server in this process (``--server moto``), or an
existing one (``--endpoint``). Each rank is a real process in a gloo group and holds a
different shard (per-rank keys and data, as in bench/save_load.py), so every method moves
ranks x MiB. Throughput is aggregate: the bytes of all ranks / wall time of the slowest rank,
clocks started after a barrier. Methods are interleaved (order rotates each repeat), and
unbroken runs right beside the raw limit (raw PUT and GET, then unbroken's save and
restore, who goes first alternating), after an untimed warm-up round; objects are deleted,
and RGW's garbage collected, after each method, so every method writes to an empty server
(the OSD keeps everything in RAM). Best and median of the repeats are reported, and fractions
of the limit are the median of each repeat's ratio. Every restore is compared with the
saved bytes; a mismatch aborts.

Methods:

- unbroken: ``Checkpointer("s3://bucket/unbroken")``, default options (16 MiB parts, 16
  requests in flight per object) but endpoint, credentials and path-style addressing;
- raw limit: each rank PUTs its bytes with ``obstore.put`` (unbroken's parts, 16 in flight,
  fed part by part as unbroken feeds its tensors) and reads them back with 16 parallel
  ``get_range`` calls of unbroken's GET size into a preallocated buffer: the same client,
  settings and request sizes as unbroken, without its format, checksums or coordination;
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
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from common import MIB, free_port, print_result, read_back, run_ranks
from limits import check_limits
from s3_clients import REGION, Server, boto3_client, remove_bucket
from s3_methods import S3Config, worker
from s3_report import report
from s3_servers import CpuAudit, ceph_version, daemon_pids, memstore_bytes, start_moto, start_rgw

CONNECTOR = "s3torchconnector"
NO_CONNECTOR = (
    "s3torchconnector is not installed: pip install 's3torchconnector[dcp]' "
    "(its DCP module also needs tenacity, from the [dcp] extra)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--replicated-mib", type=int, help="default: --mib-per-rank")
    parser.add_argument("--repeats", type=int, default=7, help="best and median are reported")
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
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        server, note, daemons = start_server(stack, args, workdir, replicated_mib)
        moto = None
        if server.kind != "moto" and missing is None:
            # where the connector's writer goes if the server rejects it (RGW 16.2 does)
            moto = replace(server, kind="moto", endpoint=start_moto(stack))
        for s in (server, moto):
            if s is not None:
                client = boto3_client(s)
                client.create_bucket(Bucket=s.bucket)
                stack.callback(remove_bucket, client, s.bucket)

        cfg = S3Config(
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
        run_ranks(worker, (cfg,), cfg.ranks)
        others = audit.others()
        raw = read_back(workdir)
    result = report(cfg, raw, note, others)
    print_result(result | {"load_average_before": load})
    check_limits(result["fraction_of_limit"], "bench/s3.py")


def start_server(
    stack: contextlib.ExitStack, args: argparse.Namespace, workdir: str, replicated_mib: int
) -> tuple[Server, str, list[int]]:
    """The server the run uses (stopped by ``stack``), a note naming it for the table,
    and the pids of its daemons where the bench started them."""
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    if args.endpoint:
        server = Server(
            "external", args.endpoint, args.access_key, args.secret_key, bucket, args.region
        )
        return server, f"S3 at {args.endpoint}", []
    if args.server == "moto":
        server = Server("moto", start_moto(stack), "test", "test", bucket)
        return server, "moto server (in the bench process)", []
    started = time.perf_counter()
    total = args.ranks * args.mib_per_rank * MIB
    memstore = memstore_bytes(total, replicated_mib * MIB, args.repeats)
    rgw = start_rgw(stack, Path(workdir) / "rgw", memstore)
    daemons = daemon_pids(rgw.directory)
    print(f"Ceph RGW up in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    conf = str(rgw.directory / "ceph.conf")
    server = Server("rgw", rgw.endpoint, rgw.access_key, rgw.secret_key, bucket, rgw.region, conf)
    return server, f"Ceph RGW {ceph_version()} (memstore OSD, in RAM) on loopback", daemons


if __name__ == "__main__":
    main()
