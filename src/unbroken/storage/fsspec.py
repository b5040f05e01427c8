"""Any file system fsspec knows (gs://, az://, memory://...), for stores without a native
backend. Its commit is create-if-absent where the file system can express it (exclusive
open), and check-then-write otherwise, which two racing writers can both pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from unbroken.errors import CheckpointError


class FsspecStorage:
    requests_in_flight = 1

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        try:
            import fsspec
        except ImportError as e:
            raise CheckpointError(f"{url}: this scheme needs `pip install fsspec` ({e})") from e
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as e:
            raise CheckpointError(f"{url}: no file system for this URL: {e}") from e
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def write(self, path: str, parts: Sequence[memoryview | bytes]) -> None:
        with self.fs.open(self._full(path), "wb") as f:
            for part in parts:
                f.write(part)

    def commit(self, path: str, data: bytes) -> None:
        full = self._full(path)
        if self.fs.exists(full):
            raise FileExistsError(f"{self.url}/{path}")
        try:
            with self.fs.open(full, "xb") as f:
                f.write(data)
        except FileExistsError:
            raise
        except (ValueError, NotImplementedError):  # no exclusive mode on this file system
            self.replace(path, data)

    def replace(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._full(path), data)

    def read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(self._full(path)))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        view = out.cast("B")
        data = self.fs.cat_file(self._full(path), start=offset, end=offset + len(view))
        if len(data) != len(view):
            raise EOFError(f"{self.url}/{path} ends before byte {offset + len(view)}")
        view[:] = data

    def size(self, path: str) -> int:
        return int(self.fs.size(self._full(path)))

    def list(self, path: str) -> list[str]:
        full = self._full(path)
        if not self.fs.isdir(full):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(full, detail=False))

    def delete(self, path: str) -> None:
        full = self._full(path)
        if self.fs.exists(full):
            self.fs.rm(full, recursive=True)

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"
