"""Who may read what this job writes: its checkpoint files, shared-memory snapshots and
event logs are the job's user's alone (files 0600, folders 0700) whatever the umask, or
also its group's (0660 / 0770) for a team that shares one checkpoint between accounts.

Modes are set with ``fchmod``/``chmod`` after creating, so a permissive umask (0, as in
many containers) never widens them and a strict one never narrows group access away.
Only what this job creates is changed: a folder that already exists keeps its mode,
except the job's own shared-memory folder, which must belong to this user (another user
who created it first could otherwise read every snapshot written into it).

The default is `Access.from_env`: private, or group access where the environment sets
``UNBROKEN_GROUP_ACCESS=1`` (so that ``unbroken run`` and every rank agree without a
parameter threaded through each component); pass an `Access` to `LocalStorage` or
`MemoryTier` to choose in code.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from unbroken.errors import CheckpointError

__all__ = ["GROUP_ENV", "Access", "read_own"]

GROUP_ENV = "UNBROKEN_GROUP_ACCESS"


@dataclass(frozen=True)
class Access:
    """Modes for what this job creates: ``group=False`` 0600/0700, ``group=True`` 0660/0770."""

    group: bool = False

    @classmethod
    def from_env(cls) -> Access:
        return cls(group=os.environ.get(GROUP_ENV, "") not in ("", "0"))

    @property
    def file_mode(self) -> int:
        return 0o660 if self.group else 0o600

    @property
    def dir_mode(self) -> int:
        return 0o770 if self.group else 0o700

    def open(self, path: str, flags: int) -> int:
        """``os.open(path, flags | O_CREAT)`` with this file mode, whatever the umask, never
        through a symlink: one planted where a file of the job's goes is refused (ELOOP),
        not written through into whatever it names."""
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, self.file_mode)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise CheckpointError(
                f"{path} is a symlink where this job writes a file of its own; remove it "
                "(unbroken never writes through a link)"
            ) from None
        try:
            os.fchmod(fd, self.file_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def size(self, path: str, nbytes: int) -> None:
        """Create ``path`` if missing, with this file mode, and make it ``nbytes`` long,
        reserved: on a full tmpfs this raises ENOSPC instead of a later write's SIGBUS."""
        fd = self.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)

    def write_text(self, path: str, text: str) -> None:
        fd = self.open(path, os.O_WRONLY | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def makedirs(self, path: str) -> None:
        """Create ``path`` and any missing parents with this folder mode; existing
        folders are left as they are (``/dev/shm``, a user's home)."""
        path = os.path.abspath(path)
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        if parent != path:
            self.makedirs(parent)
        try:
            os.mkdir(path, self.dir_mode)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
            return  # made by another rank at the same moment: it set the mode
        os.chmod(path, self.dir_mode)

    def own_dir(self, path: str) -> None:
        """Make ``path`` (a folder only this job writes into) exist with this folder mode,
        refusing one that belongs to another user, whose files could then be mistaken
        for this job's and who could read what is written into it."""
        self.makedirs(path)
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            raise CheckpointError(
                f"{path} is a symlink where this job's own folder goes; remove it (the job "
                "never writes through a link)"
            )
        if info.st_uid != os.geteuid():
            raise CheckpointError(
                f"{path} belongs to user id {info.st_uid}, not this job's user "
                f"({os.geteuid()}); remove it or choose another folder "
                f"(UNBROKEN_MEMORY_DIR, or the job name)"
            )
        if info.st_mode & 0o777 != self.dir_mode:
            os.chmod(path, self.dir_mode)


def read_own(path: str) -> bytes:
    """A file the job wrote (a slot's description, an owner file, the DDP layouts), read
    whole and never through a symlink: one planted in its place raises OSError (ELOOP)."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        return f.read()
