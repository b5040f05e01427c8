"""Local file system (and NFS): fsync'd writes, commit by exclusive hard link."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence

from unbroken.errors import CheckpointError


class LocalStorage:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointError(
                f"{self.root} is a file, not a checkpoint directory; pass a directory path"
            )

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path)

    def write(self, path: str, parts: Sequence[memoryview | bytes]) -> None:
        full = self._full(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(os.path.dirname(full))

    def commit(self, path: str, data: bytes) -> None:
        full = self._full(path)
        tmp = f"{full}.{uuid.uuid4().hex}.tmp"
        self.write(os.path.relpath(tmp, self.root), [data])
        try:
            # link() fails if the target exists, so a commit never replaces another one.
            os.link(tmp, full)
        finally:
            os.unlink(tmp)
        _fsync_dir(os.path.dirname(full))

    def read(self, path: str) -> bytes:
        with open(self._full(path), "rb") as f:
            return f.read()

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        view = out.cast("B")
        fd = os.open(self._full(path), os.O_RDONLY)
        try:
            while view:
                n = os.preadv(fd, [view], offset)
                if n == 0:
                    raise EOFError(f"{self._full(path)} ends before byte {offset + len(view)}")
                view, offset = view[n:], offset + n
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        return os.stat(self._full(path)).st_size

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._full(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, path: str) -> None:
        full = self._full(path)
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif os.path.lexists(full):
            os.unlink(full)

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
