"""The shared memory of simulated nodes (``unbroken run --simulate-nodes``): one
directory per node under `unbroken.run.contract.SIM_MEMORY_ROOT`, handed to its workers
as ``$UNBROKEN_MEMORY_DIR``, and lost with the node when it is killed."""

from __future__ import annotations

import os
import shutil
import uuid

from unbroken.access import Access
from unbroken.run.contract import SIM_MEMORY_ROOT


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
