"""Shared memory from the launcher's side: the folders of simulated nodes (``unbroken run
--simulate-nodes``: one per node under `unbroken.run.contract.SIM_MEMORY_ROOT`, handed to
its workers as ``$UNBROKEN_MEMORY_DIR``, and lost with the node when it is killed), who
owns a job's folder, and freeing the folders of a launch that ended normally."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from unbroken.access import Access, read_own
from unbroken.run import contract
from unbroken.run.contract import SIM_MEMORY_ROOT

log = logging.getLogger("unbroken")


class NodeMemory:
    """The node directories of one launch, under a job directory of their own."""

    def __init__(self, job: str) -> None:
        self.root = os.path.join(SIM_MEMORY_ROOT, job)

    def path(self, node: int) -> str:
        return os.path.join(self.root, f"node-{node}")

    def create(self, node: int) -> str:
        Access.from_env().makedirs(self.path(node))  # private, whatever the umask
        return self.path(node)

    def lose(self, node: int) -> str:
        """Take ``node``'s shared memory away from it, as a lost machine's is: the
        directory is renamed at once (a replacement finds it empty); the caller deletes
        the returned path, which frees the pages and takes a while."""
        lost = f"{self.path(node)}.lost-{uuid.uuid4().hex[:8]}"
        os.rename(self.path(node), lost)
        Access.from_env().makedirs(self.path(node))
        return lost

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def owners(folder: str) -> list[int | None]:
    """The pids a job folder's owner files name (None: one of another pid namespace or
    host, which cannot be judged from here); [] if it has none or is not ours to read."""
    try:
        names = [f for f in os.listdir(folder) if f.startswith(contract.OWNER_PREFIX)]
    except OSError:  # another user's job: private
        return []
    pids = []
    for name in names:
        try:
            pids.append(contract.owner_pid(read_own(os.path.join(folder, name)).decode()))
        except (OSError, ValueError):
            pids.append(None)
    return pids


def free_finished(root: str, events_dir: str) -> list[str]:
    """Remove the job folders under ``root`` that only workers of this launch owned (the
    pids its event logs name): the job ended normally, so nothing will restore from them.
    A crash's memory stays for the restart; what no launcher frees, the next job of this
    user on the node does, once every owner has exited."""
    names = (p.stem.rsplit("-", 1)[1] for p in Path(events_dir).glob("events-*-*.jsonl"))
    ours = {int(pid) for pid in names if pid.isdigit()}
    freed: list[str] = []
    try:
        folders = [os.path.join(root, name) for name in os.listdir(root)]
    except OSError:
        return freed
    for folder in folders:
        pids = owners(folder)
        if pids and all(pid in ours for pid in pids) and not os.path.islink(folder):
            shutil.rmtree(folder, ignore_errors=True)
            freed.append(folder)
    if freed:
        log.info("the job ended normally: freed its shared memory %s", freed)
    return freed
