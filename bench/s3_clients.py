"""The S3 clients of bench/s3.py other than unbroken's: a server's address and keys, boto3
on it, the S3 connector for PyTorch as DCP storage, and a counter of the bytes a
checkpointer fetches."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

REGION = "us-east-1"


@dataclass(frozen=True)
class Server:
    kind: str  # "rgw", "moto" or "external"
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = REGION
    ceph_conf: str | None = None  # an RGW the bench started: its garbage is collected at once

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


def collect_garbage(server: Server) -> None:
    """Have an RGW the bench started reclaim deleted objects now, between clocks, instead
    of every 30 s in the middle of one (it shares the ranks' CPUs)."""
    if server.ceph_conf is not None:
        command = ["radosgw-admin", "-c", server.ceph_conf, "gc", "process", "--include-all"]
        subprocess.run(command, check=True, capture_output=True, timeout=300)


def small_get_ms(store: Any, key: str, size: int, count: int) -> list[float]:
    """The time of ``count`` ranged GETs of ``size`` bytes of ``key``, one at a time, in ms."""
    import obstore

    times = []
    for i in range(count):
        start = time.perf_counter()
        obstore.get_range(store, key, start=i * size, length=size)
        times.append((time.perf_counter() - start) * 1000)
    return times


def remove_bucket(client: Any, bucket: str) -> None:
    with contextlib.suppress(Exception):  # the server may be gone already
        delete_prefix(client, bucket, "")
        client.delete_bucket(Bucket=bucket)


class FetchCounter:
    """Counts the bytes a checkpointer's storage fetches (GETs), from every thread."""

    def __init__(self, storage: Any) -> None:
        self.bytes = 0
        self._lock = threading.Lock()
        # every ranged GET of S3Storage (read_into, read_scatter) goes through read_range
        read_range, read = storage.read_range, storage.read

        def counted_read_range(path: str, offset: int, length: int) -> memoryview:
            self.add(length)
            return read_range(path, offset, length)

        def counted_read(path: str) -> bytes:
            data: bytes = read(path)
            self.add(len(data))
            return data

        storage.read_range, storage.read = counted_read_range, counted_read

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
