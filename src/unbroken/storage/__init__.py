"""Storage backends behind one small protocol, chosen by URI scheme.

Paths are ``str`` relative to the backend's root, with ``/`` separators: a URI is not a
`pathlib.Path`. Every backend passes the same contract tests (tests/test_storage.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from unbroken.errors import CheckpointError


class Storage(Protocol):
    """Where checkpoints live. Only `commit` makes anything visible to readers."""

    def write(self, path: str, parts: Sequence[memoryview | bytes]) -> None:
        """Write ``parts`` back to back as ``path``; durable when this returns."""
        ...

    def commit(self, path: str, data: bytes) -> None:
        """Create ``path`` atomically, all or nothing, and durably. Raise
        `FileExistsError` if it exists: two writers never both win."""
        ...

    def read(self, path: str) -> bytes: ...

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``path`` from ``offset``; `EOFError` if short."""
        ...

    def size(self, path: str) -> int:
        """Size in bytes; `FileNotFoundError` if ``path`` does not exist."""
        ...

    def list(self, path: str) -> list[str]:
        """Names directly under the directory ``path`` (empty if there is none)."""
        ...

    def delete(self, path: str) -> None:
        """Remove ``path`` and everything under it; no error if absent."""
        ...


def open_storage(uri: str | os.PathLike[str]) -> Storage:
    from unbroken.storage.local import LocalStorage

    text = os.fspath(uri)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return LocalStorage(text)
    if scheme == "file":
        return LocalStorage(rest)
    raise CheckpointError(f"{text}: storage scheme {scheme!r} is not supported; use a local path")
