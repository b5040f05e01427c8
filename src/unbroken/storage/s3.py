"""S3-compatible object storage through obstore (Rust, releases the GIL).

Object storage is not a file system, so this backend never renames or copies:

- data objects go up as parallel multipart uploads of parts of about ``part_size``;
- `commit` is a conditional PUT (``If-None-Match: *``) of a small object: of two writers
  of one step, the second gets `FileExistsError`;
- reads are parallel ranged GETs of ``part_size`` pieces;
- throttling (503 SlowDown), 5xx, timeouts and dropped connections are retried with
  exponential backoff and jitter until ``retry_timeout``; past it the error names the
  object, the operation and what the server said, or the endpoint it could not reach
  and after how long (storage/s3_errors.py).

Multipart uploads that a failure (or a killed process) leaves behind are aborted when
their object's write fails and when their step is deleted. obstore does not list
multipart uploads, so that one chore goes through boto3.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

from unbroken.errors import CheckpointError
from unbroken.storage.pacing import Pacing
from unbroken.storage.s3_errors import (
    EndpointUnreachable,
    boto3_credentials,
    no_such_bucket,
    s3_error,
)
from unbroken.storage.s3_options import S3Options, addressing, with_environment

__all__ = ["MIN_PART", "S3Options", "S3Storage", "upload_parts"]

MIN_PART = 5 << 20  # S3's smallest part, but the last


class S3Storage:
    def __init__(self, uri: str, options: S3Options) -> None:
        from obstore.store import S3Store

        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise CheckpointError(f"{uri}: name a bucket, as in s3://bucket/prefix")
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.options = options = with_environment(options)
        config: dict[str, Any] = {"virtual_hosted_style_request": not options.uses_path_style}
        if options.endpoint:
            config["endpoint"] = self._bucket_endpoint()
            config["allow_http"] = options.endpoint.startswith("http://")
        if options.region:
            config["region"] = options.region
        provider = None
        if options.access_key_id:
            config["access_key_id"] = options.access_key_id
            config["secret_access_key"] = options.secret_access_key
            if options.session_token:
                config["session_token"] = options.session_token
        elif not os.environ.get("AWS_ACCESS_KEY_ID"):
            provider = boto3_credentials(uri, bucket)
        self.store = S3Store(
            bucket,
            prefix=self.prefix or None,
            config=config,  # type: ignore[arg-type]
            client_options={
                "timeout": timedelta(seconds=options.timeout),
                "connect_timeout": timedelta(seconds=min(options.timeout, 10)),
            },
            retry_config={
                "max_retries": options.max_retries,
                "retry_timeout": timedelta(seconds=options.retry_timeout),
                "backoff": {
                    "init_backoff": timedelta(milliseconds=100),
                    "max_backoff": timedelta(seconds=5),
                    "base": 2,
                },
            },
            credential_provider=provider,
        )
        self._pool = ThreadPoolExecutor(options.concurrency, thread_name_prefix="unbroken-s3")
        # HTTP requests issued, by method (retries not counted): what a save or restore
        # costs on a store that bills per request
        self.requests: Counter[str] = Counter()
        self._counting = threading.Lock()
        self.pacing = Pacing()  # what requests took: sizes the ranged GETs

    def _count(self, method: str, n: int = 1) -> None:
        with self._counting:
            self.requests[method] += n

    def _bucket_endpoint(self) -> str | None:
        """The endpoint obstore sends requests to: with virtual-hosted addressing, it takes
        the endpoint as the bucket's own, so the bucket goes in front of the host name."""
        endpoint = self.options.endpoint
        if not endpoint or self.options.uses_path_style:
            return endpoint
        parts = urlsplit(endpoint)
        if (parts.hostname or "").startswith(f"{self.bucket}."):
            return endpoint
        return parts._replace(netloc=f"{self.bucket}.{parts.netloc}").geturl()

    def _where(self, path: str) -> str:
        return f"{self.uri}/{path}"

    @contextlib.contextmanager
    def _request(self, operation: str, path: str, detail: str = "") -> Iterator[None]:
        """Any error of the client becomes a `CheckpointError` naming the operation, the
        object and what the server said; `FileNotFoundError` (no such object, but not no
        such bucket), `FileExistsError` and `EOFError` keep their meaning."""
        start = time.monotonic()
        what = f"{operation} {self._where(path)}{detail}"
        try:
            yield
        except FileNotFoundError as e:
            if not no_such_bucket(e):
                raise FileNotFoundError(f"{self._where(path)}: no such object") from None
            raise s3_error(what, e, time.monotonic() - start, self.options, self.bucket) from e
        except (FileExistsError, EOFError, CheckpointError):
            raise
        except Exception as e:
            raise s3_error(what, e, time.monotonic() - start, self.options, self.bucket) from e

    def write(self, path: str, parts: Sequence[memoryview | bytes]) -> None:
        import obstore

        total = sum(memoryview(p).nbytes for p in parts)
        count, part = upload_parts(total, self.options.part_size)
        multipart = count > 1
        if multipart:  # create and complete, and one PUT per part
            self._count("POST", 2)
        self._count("PUT", count)
        try:
            with self._request("PUT", path, f" ({total} bytes{', multipart' * multipart})"):
                obstore.put(
                    self.store,
                    path,
                    iter([memoryview(p).cast("B") for p in parts]),
                    use_multipart=multipart,
                    chunk_size=part,
                    max_concurrency=self.options.concurrency,
                )
        except EndpointUnreachable:
            raise  # an abort would fail the same way; deleting the step aborts them later
        except CheckpointError:
            self._abort_uploads(path)
            raise

    def commit(self, path: str, data: bytes) -> None:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        self._count("PUT")
        with self._request("conditional PUT", path):
            try:
                obstore.put(self.store, path, data, mode="create")
            except (AlreadyExistsError, PreconditionError):
                raise FileExistsError(self._where(path)) from None

    def replace(self, path: str, data: bytes) -> None:
        import obstore

        self._count("PUT")
        with self._request("PUT", path):
            obstore.put(self.store, path, data)  # a PUT replaces an object atomically

    def read(self, path: str) -> bytes:
        import obstore

        self._count("GET")
        start = time.monotonic()
        with self._request("GET", path):
            data = bytes(obstore.get(self.store, path).bytes())
        self.pacing.record(len(data), time.monotonic() - start)
        return data

    @property
    def requests_in_flight(self) -> int:
        return self.options.concurrency

    @property
    def part_size(self) -> int:
        """The size of one upload part, and the most a ranged GET reads."""
        return self.options.part_size

    @property
    def smallest_request(self) -> int | None:
        """The smallest ranged GET worth its round trip, from what this storage's
        requests took so far (`unbroken.storage.pacing`); None before any."""
        return self.pacing.efficient_bytes()

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """In ranged GETs of the parts an upload of this size would have (`upload_parts`:
        a read a few KB over the part size is one GET, not two), in parallel, each copied
        into ``out`` from the buffer obstore received it in."""
        view = out.cast("B")
        _, piece = upload_parts(len(view), self.options.part_size)
        pieces = [view[s : s + piece] for s in range(0, len(view), piece)]
        starts = range(offset, offset + len(view), piece)
        if len(pieces) == 1:
            pieces[0][:] = self.read_range(path, offset, len(view))
            return
        jobs = [
            self._pool.submit(self.read_range, path, s, len(p))
            for s, p in zip(starts, pieces, strict=True)
        ]
        for job, p in zip(jobs, pieces, strict=True):
            p[:] = job.result()

    def read_scatter(self, path: str, parts: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each ``(start, out)`` of ``parts`` from ``path``'s byte ``start``: one ranged
        GET of the span they cover, copied straight into each (gaps between them dropped)."""
        first = min(start for start, _ in parts)
        data = self.read_range(path, first, max(start + len(out) for start, out in parts) - first)
        for start, out in parts:
            out.cast("B")[:] = data[start - first : start - first + len(out)]

    def read_range(self, path: str, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of ``path``, in one GET, in the buffer the client
        received them in (no copy; it lives as long as the view); `EOFError` if short."""
        import obstore

        self._count("GET")
        end, start = offset + length, time.monotonic()
        try:
            with self._request("GET", path, f" (bytes {offset}-{end})"):
                data = memoryview(obstore.get_range(self.store, path, start=offset, length=length))
            self.pacing.record(length, time.monotonic() - start)
        except CheckpointError as e:
            if self.size(path) < end:
                raise EOFError(f"{self._where(path)} ends before byte {end}") from e
            raise
        if len(data) != length:
            raise EOFError(f"{self._where(path)} ends before byte {end}")
        return data

    def size(self, path: str) -> int:
        import obstore

        self._count("HEAD")
        start = time.monotonic()
        with self._request("HEAD", path):
            size = int(obstore.head(self.store, path)["size"])
        self.pacing.record(0, time.monotonic() - start)
        return size

    def list(self, path: str) -> list[str]:
        import obstore

        self._count("LIST")
        with self._request("LIST", f"{path}/" if path else ""):
            listing = obstore.list_with_delimiter(self.store, path or None)
        names = [p.rsplit("/", 1)[-1] for p in listing["common_prefixes"]]
        names += [o["path"].rsplit("/", 1)[-1] for o in listing["objects"]]
        return sorted(names)

    def delete(self, path: str) -> None:
        import obstore

        self._count("LIST")
        with self._request("LIST", f"{path}/"):
            paths = [o["path"] for batch in obstore.list(self.store, path) for o in batch]
        self._count("DELETE")
        with (
            self._request("DELETE", path, f" and {len(paths)} objects under it"),
            contextlib.suppress(FileNotFoundError),  # deleting nothing is fine
        ):
            obstore.delete(self.store, [path, *paths])
        self._abort_uploads(f"{path}/")

    def _abort_uploads(self, path: str) -> None:
        """Abort multipart uploads in progress under ``path`` (best effort: a bucket
        lifecycle rule for incomplete uploads is the backstop)."""
        key = f"{self.prefix}/{path}" if self.prefix else path
        start = time.monotonic()
        try:
            pages = self._boto3.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=key
            )
            for page in pages:
                self._count("LIST")
                for upload in page.get("Uploads", []):
                    self._count("DELETE")
                    self._boto3.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
        except Exception as e:  # never hide the error that brought us here
            what = f"LIST and ABORT multipart uploads under {self._where(path)}"
            error = s3_error(what, e, time.monotonic() - start, self.options, self.bucket)
            logging.getLogger("unbroken").warning("could not abort uploads: %s", error)

    @cached_property
    def _boto3(self) -> Any:
        import boto3
        from botocore.config import Config

        o = self.options
        return boto3.client(
            "s3",
            endpoint_url=o.endpoint,
            region_name=o.region,
            aws_access_key_id=o.access_key_id,
            aws_secret_access_key=o.secret_access_key,
            aws_session_token=o.session_token,
            config=Config(
                s3={"addressing_style": addressing(o)},
                retries={"mode": "standard", "max_attempts": 5},
            ),
        )

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r})"


def upload_parts(total: int, part_size: int) -> tuple[int, int]:
    """How many parts an object of ``total`` bytes goes up in, and their size: about
    ``part_size``, evened out so that no small last part costs a request of its own (a
    shard file is its tensors plus a header of a few KB: 16 x 16 MiB + 30 KB would
    otherwise take a 17th PUT). One part: a plain PUT."""
    count = max(1, min(round(total / part_size), total // MIN_PART))  # parts >= 5 MiB
    part = max(-(-total // count), 1)
    return max(1, -(-total // part)), part
