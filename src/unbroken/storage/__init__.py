"""Storage backends behind one small protocol, chosen by URI scheme.

Paths are ``str`` relative to the backend's root, with ``/`` separators: a URI is not a
`pathlib.Path`. Every backend passes the same contract tests (tests/test_storage.py).

Entry points: local.
May import: access, errors, run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from unbroken.errors import CheckpointError


class Storage(Protocol):
    """Where checkpoints live. Only `commit` makes anything visible to readers."""

    @property
    def requests_in_flight(self) -> int:
        """How many requests this backend serves best at once: a reader of many blocks
        keeps at least this many in flight (an object store's connection pool; 1 for a
        disk, whose readers use their own thread count)."""
        ...

    def write(self, path: str, parts: Sequence[memoryview | bytes]) -> None:
        """Write ``parts`` back to back as ``path``; durable when this returns."""
        ...

    def commit(self, path: str, data: bytes) -> None:
        """Create ``path`` atomically, all or nothing, and durably. Raise
        `FileExistsError` if it exists: two writers never both win."""
        ...

    def replace(self, path: str, data: bytes) -> None:
        """Create or replace ``path`` atomically and durably (the ``latest`` pointer)."""
        ...

    def read(self, path: str) -> bytes: ...

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``path`` from ``offset``; `EOFError` if short."""
        ...

    # Optional, for backends whose reads arrive in buffers of their own:
    # ``read_scatter(path, parts)`` (S3) fills each ``(start, out)`` of ``parts`` in one
    # request (readers without it make one `read_into` per part:
    # `unbroken.format.blockio.read_scatter`); ``read_range(path, offset, length) -> memoryview``
    # (S3: the response's buffer; local files: their pages, mapped) hands over a range
    # without copying it, which a restore keeps until every rank has checked what it read
    # (`unbroken.format.shards.read_held`) instead of backing up the state it overwrites.

    def size(self, path: str) -> int:
        """Size in bytes; `FileNotFoundError` if ``path`` does not exist."""
        ...

    def list(self, path: str) -> list[str]:
        """Names directly under the directory ``path`` (empty if there is none)."""
        ...

    def delete(self, path: str) -> None:
        """Remove ``path`` and everything under it; no error if absent."""
        ...


def open_storage(uri: str | os.PathLike[str], options: dict[str, Any] | None = None) -> Storage:
    """The backend for ``uri``: a local path, ``s3://bucket/prefix`` (options: see
    `S3Options`), or any other URL fsspec knows (options go to its file system)."""
    from unbroken.storage.local import LocalStorage

    text = os.fspath(uri)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme == "file":
        if options:
            raise CheckpointError(f"{text}: a local path takes no storage options")
        return LocalStorage(rest if sep else text)
    if scheme == "s3":
        try:
            from unbroken.storage.s3 import S3Options, S3Storage
        except ImportError as e:
            raise CheckpointError(f"{text}: S3 needs `pip install 'unbroken[s3]'` ({e})") from e
        return S3Storage(text, S3Options.from_dict(options or {}))
    from unbroken.storage.fsspec import FsspecStorage

    return FsspecStorage(text, options or {})
