"""Names and housekeeping of the shared-memory tier's folders: a job's folder name, the
rank a folder is named for, the root they live in, and removing the memory of jobs whose
processes are gone.

A job's folder name is its name made safe for a file name *and* a hash of the name
itself, so two names that read alike once sanitised (``exp/1``, ``exp_1``) never share a
folder. The root is this user's (``/dev/shm/unbroken-<uid>`` by default): a root that
another user owns, or that others may write into without the sticky bit, is refused,
since whoever controls it can swap the folders inside for their own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat

from unbroken.access import Access
from unbroken.errors import CheckpointError
from unbroken.run.nodes import owners

log = logging.getLogger("unbroken")


def rank_of(name: str) -> int | None:
    if not name.startswith("rank-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def job_name(location: str) -> str:
    """The default job name of checkpoints at ``location``: torchrun's run id (not its
    ``"none"``, which every job without ``--rdzv-id`` shares) and the location, made
    absolute, so two jobs that both say ``"ckpt"`` in different folders never meet."""
    where = location if "://" in location else os.path.abspath(location)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return where if run in ("", "none") else f"{run}:{where}"


def folder_name(job: str) -> str:
    """The job's folder: readable, and distinct for distinct names (a hash of the name)."""
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)[-48:].lstrip(".")
    return f"{readable or 'job'}-{hashlib.sha256(job.encode()).hexdigest()[:16]}"


def private_root(root: str, access: Access) -> None:
    """Create the root if missing (this user's, with ``access``'s folder mode), and refuse
    one that is a symlink, belongs to another user, or lets others write into it without
    the sticky bit (``/dev/shm`` itself, root's and sticky, is fine)."""
    access.makedirs(root)
    info = os.lstat(root)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(
            f"{root} is not a folder (a symlink?); remove it or set UNBROKEN_MEMORY_DIR"
        )
    mine = info.st_uid == os.geteuid()
    sticky = info.st_mode & stat.S_ISVTX and (mine or info.st_uid == 0)
    if not (mine or sticky) or (info.st_mode & stat.S_IWOTH and not sticky):
        raise CheckpointError(
            f"{root} (owner uid {info.st_uid}, mode {info.st_mode & 0o7777:o}) is not this "
            f"user's (uid {os.geteuid()}): whoever controls it could swap the snapshots in it. "
            "Remove it, or point UNBROKEN_MEMORY_DIR at a folder of your own"
        )


def clean_abandoned(root: str, job: str) -> None:
    """Remove the shared memory of other jobs whose processes are all gone. A job whose
    owners live in another pid namespace (a container sharing ``/dev/shm``) or another
    host is left alone: its pids cannot be judged from here."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        folder = os.path.join(root, name)
        if name == folder_name(job) or not _plain_dir(folder):
            continue
        pids = owners(folder)
        if pids and all(pid is not None and not process_exists(pid) for pid in pids):
            log.info("removing shared memory of abandoned job %s", name)
            shutil.rmtree(folder, ignore_errors=True)


def _plain_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
