"""Local file system (and NFS): fsync'd writes (large files past the page cache:
`unbroken.storage.direct`), commit by exclusive hard link.

A checkpoint folder may hold what someone else put there, so nothing in it steers a
write or a delete outside it: below the root, writes and deletes go one folder at a time
from an open descriptor of the root (``openat``), never through a symbolic link. A write
through a link is refused with the link's path; deleting a link removes the link, never
what it points to (a fine-tune run whose step folder links a pre-training step leaves
that step whole). Reads refuse a file that is a link (``O_NOFOLLOW``), so that no link
shows the bytes of a file outside the checkpoint; they may go through a linked folder,
whose files are then checked against the manifest like any others. The root itself is
the user's choice and may be reached through links.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Sequence

from unbroken.access import Access
from unbroken.errors import CheckpointError, CorruptCheckpointError, StorageError
from unbroken.run import faults
from unbroken.storage import direct

log = logging.getLogger("unbroken")

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class LocalStorage:
    """Checkpoints under ``root``. Files are created 0600 and folders 0700 (or 0660 / 0770
    with ``Access(group=True)``) whatever the umask; the default is `Access.from_env`."""

    requests_in_flight = 1

    def __init__(self, root: str, access: Access | None = None) -> None:
        self.root = os.path.abspath(root)
        self.access = access or Access.from_env()
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointError(
                f"{self.root} is a file, not a checkpoint directory; pass a directory path"
            )

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path)

    def write(self, path: str, parts: Sequence[memoryview | bytes]) -> None:
        folder, name = self._folder(path)
        try:
            self._write_at(folder, name, self._full(path), parts)
            os.fsync(folder)
        finally:
            os.close(folder)

    def _write_at(
        self, folder: int, name: str, full: str, parts: Sequence[memoryview | bytes]
    ) -> None:
        fd = self._create(folder, name, full)
        try:
            if not direct.write(fd, parts):
                _write_buffered(fd, parts)
            faults.point("fsync")
            os.fsync(fd)
        finally:
            os.close(fd)

    def _create(self, folder: int, name: str, full: str) -> int:
        """``name`` in ``folder`` opened empty for writing, with this storage's mode: a
        file of its own, never a link's target nor a file with another name elsewhere."""
        mode = self.access.file_mode
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, mode, dir_fd=folder)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _linked(full, full) from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
                raise StorageError(
                    f"{full} is not a file of this checkpoint's own (a hard link, a device or "
                    f"a pipe): writing it could change a file elsewhere; remove it, or save "
                    f"to another folder"
                )
            os.fchmod(fd, mode)
            os.ftruncate(fd, 0)  # only now: a refused file keeps its bytes
        except BaseException:
            os.close(fd)
            raise
        return fd

    def commit(self, path: str, data: bytes) -> None:
        # link() fails if the target exists (a link too), so a commit never replaces another.
        self._publish(path, data, _link_at)

    def replace(self, path: str, data: bytes) -> None:
        # rename() replaces a link planted under the name, never what it points to.
        self._publish(path, data, _replace_at)

    def _publish(self, path: str, data: bytes, move: Callable[[str, str, int], None]) -> None:
        """Write ``data`` durably under a temporary name, then ``move`` it into place,
        both in the one folder opened for it."""
        folder, name = self._folder(path)
        tmp = f"{name}.{uuid.uuid4().hex}.tmp"
        try:
            self._write_at(folder, tmp, self._full(path), [data])
            try:
                move(tmp, name, folder)
            finally:
                with contextlib.suppress(FileNotFoundError):  # gone if it was moved
                    os.unlink(tmp, dir_fd=folder)
            os.fsync(folder)
        finally:
            os.close(folder)

    def read(self, path: str) -> bytes:
        with os.fdopen(self._open(path), "rb") as f:
            return f.read()

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        view = out.cast("B")
        fd = self._open(path)
        try:
            while view:
                n = os.preadv(fd, [view], offset)
                if n == 0:
                    raise EOFError(f"{self._full(path)} ends before byte {offset + len(view)}")
                view, offset = view[n:], offset + n
        finally:
            os.close(fd)

    def read_range(self, path: str, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of ``path``: a read-only map of its pages in the
        page cache, read ahead at once; nothing is copied until the caller copies. What a
        restore holds until every rank has checked its part, at no cost in memory (a
        `Backup` of the state costs an allocation and a copy). The file must not shrink
        while the view lives (a committed checkpoint's files never change); `EOFError` if
        it is short now."""
        full = self._full(path)
        fd = self._open(path)
        try:
            if os.fstat(fd).st_size < offset + length:
                raise EOFError(f"{full} ends before byte {offset + length}")
            if length == 0:
                return memoryview(b"")
            if hasattr(os, "posix_fadvise"):  # the disk reads on while the caller checks
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            skip = offset % mmap.ALLOCATIONGRANULARITY
            try:
                mapped = mmap.mmap(fd, skip + length, offset=offset - skip, access=mmap.ACCESS_READ)
            except OSError:  # a file system that cannot map files: read a copy
                out = memoryview(bytearray(length))
                self.read_into(path, offset, out)
                return out
        finally:
            os.close(fd)
        return memoryview(mapped)[skip:]

    def _open(self, path: str) -> int:
        """``path`` opened for reading; `CorruptCheckpointError` if it is a link."""
        full = self._full(path)
        try:
            return os.open(full, os.O_RDONLY | _NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ELOOP and os.path.islink(full):
                raise _unfollowed(full) from None
            raise

    def size(self, path: str) -> int:
        full = self._full(path)
        info = os.stat(full, follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            raise _unfollowed(full)
        return info.st_size

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._full(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, path: str) -> None:
        """Remove ``path`` and all it holds. A link is removed itself, never what it points
        to; a path that goes through a linked folder is not this storage's to delete, and
        is left (deleting the link's own name removes the link)."""
        if not path.strip("/"):
            shutil.rmtree(self.root, ignore_errors=True)
            return
        try:
            folder, name = self._folder(path, create=False)
        except (FileNotFoundError, NotADirectoryError, StorageError):
            return  # a folder on the way is absent, a file, or a link (StorageError)
        try:
            mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):  # rmtree by descriptors: it never follows a link inside
                shutil.rmtree(name, ignore_errors=True, dir_fd=folder)
                return
            if stat.S_ISLNK(mode):
                log.info("removing the link %s, not what it points to", self._full(path))
            os.unlink(name, dir_fd=folder)
        except FileNotFoundError:
            pass  # deleting what is absent is no error
        finally:
            os.close(folder)

    def _folder(self, path: str, create: bool = True) -> tuple[int, str]:
        """An open descriptor of the folder of ``path`` and the last name of ``path``.
        Reached from the root one folder at a time, none opened through a link, so that
        no link on the way (one swapped in meanwhile too) sends what follows elsewhere:
        a link there raises `StorageError` naming it. ``create``: make missing folders."""
        *folders, name = _names(path)
        if create:
            self.access.makedirs(self.root)
        fd = os.open(self.root, _FOLDER)
        try:
            for depth, folder in enumerate(folders):
                if create:
                    _mkdir(fd, folder, self.access.dir_mode)
                try:
                    sub = os.open(folder, _FOLDER | os.O_NOFOLLOW, dir_fd=fd)
                except NotADirectoryError:  # what O_NOFOLLOW gives for a link, with O_DIRECTORY
                    here = os.path.join(self.root, *folders[: depth + 1])
                    if os.path.islink(here):
                        raise _linked(here, self._full(path)) from None
                    raise
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"


# Asking the kernel to start writing each piece back as soon as it is in the page cache
# overlaps the disk with the copying of the next piece; plain write-then-fsync does the two
# one after the other. Measured here: about 2x faster for 2 x 512 MiB (bench/save_load.py).
# Asked once per piece, not per part written: per tensor, it doubled the CPU time of
# writing 10 MiB in 156 parts.
_WRITEBACK_BYTES = 16 << 20


def _writeback_starter() -> Callable[[int, int, int], None]:
    # The symbols the process already has (libc's among them), not `find_library`, which
    # forks the importing process (a training job's, hundreds of MiB) to run ldconfig.
    sync_file_range = getattr(ctypes.CDLL(None), "sync_file_range", None)
    if sync_file_range is None:  # not Linux: fsync alone still makes the file durable
        return lambda fd, offset, length: None
    sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    write = 2  # SYNC_FILE_RANGE_WRITE: start writeback, do not wait for it

    def start(fd: int, offset: int, length: int) -> None:
        sync_file_range(fd, offset, length, write)

    return start


_start_writeback = _writeback_starter()


def _write_buffered(fd: int, parts: Sequence[memoryview | bytes]) -> None:
    offset = started = 0  # writeback is asked for in pieces, not per small part
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            n = os.write(fd, view[:_WRITEBACK_BYTES])
            view, offset = view[n:], offset + n
            if offset - started >= _WRITEBACK_BYTES:
                _start_writeback(fd, started, offset - started)
                started = offset


def _names(path: str) -> list[str]:
    """The names along ``path``, refused if one would leave the folder it is in."""
    names = [name for name in path.split("/") if name]
    if not names or any(name in (".", "..") for name in names):
        raise CheckpointError(f"{path!r} is not a path of a file inside the checkpoint folder")
    return names


def _mkdir(folder: int, name: str, mode: int) -> None:
    """Make the folder ``name`` in ``folder`` with ``mode`` whatever the umask; one that
    exists keeps its mode (another rank may have made it at the same moment)."""
    try:
        os.mkdir(name, mode, dir_fd=folder)
    except FileExistsError:
        return  # a folder, or what opening it next refuses (a link, a file)
    fd = os.open(name, _FOLDER | os.O_NOFOLLOW, dir_fd=folder)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _link_at(tmp: str, name: str, folder: int) -> None:
    os.link(tmp, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)


def _replace_at(tmp: str, name: str, folder: int) -> None:
    os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)


def _linked(link: str, full: str) -> StorageError:
    return StorageError(
        errno.ELOOP,
        f"{link} is a symbolic link; unbroken does not write through links in a checkpoint "
        f"folder (writing {full} could change a file outside it): remove the link, or save "
        f"to another folder",
    )


def _unfollowed(full: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{full} is a symbolic link, not a file unbroken wrote; links in a checkpoint folder "
        f"are not followed (one could show any file this user may read): replace it with a "
        f"copy of the file it names, or remove it"
    )
