"""Names and housekeeping of the shared-memory tier's folders: a job's folder name, the
rank a folder is named for, and removing the memory of jobs whose processes are gone."""

from __future__ import annotations

import logging
import os
import shutil

log = logging.getLogger("unbroken")


def rank_of(name: str) -> int | None:
    if not name.startswith("rank-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def safe(job: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "job"


def shared_root(root: str) -> None:
    """Create the node's shared-memory root if missing, like ``/tmp``: every user may make
    a folder in it (each job's own is private: `unbroken.access`), none may remove
    another's (the sticky bit)."""
    if os.path.isdir(root):
        return
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        return  # another rank made it at the same moment
    os.chmod(root, 0o1777)


def clean_abandoned(root: str, job: str) -> None:
    """Remove the shared memory of other jobs whose processes are all gone."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        folder = os.path.join(root, name)
        if name == safe(job) or not os.path.isdir(folder):
            continue
        try:
            names_in = os.listdir(folder)
        except OSError:  # another user's job: private, and not ours to clean
            continue
        pids = []
        for owner in (f for f in names_in if f.startswith("owner-")):
            try:
                with open(os.path.join(folder, owner)) as f:
                    pids.append(int(f.read()))
            except (OSError, ValueError):
                continue
        if pids and not any(process_exists(pid) for pid in pids):
            log.info("removing shared memory of abandoned job %s", name)
            shutil.rmtree(folder, ignore_errors=True)


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
