"""Claims: which writer is saving a step that is not committed yet.

Before any rank writes a byte of step N, rank 0 creates ``step-N/claim.json`` with the
storage's exclusive create (`Storage.commit`): of two jobs saving the same step to one
path, one claims it and the other is refused with a clear error before it writes
anything. Without claims both would write the same shard files, and the manifest the
winner commits could describe the loser's bytes (tests/test_concurrency.py found it).

A claim left by a save that crashed must not block the job that restarts and saves the
same step again, nor may the first pass of a new Checkpointer (which removes the folders
of uncommitted saves) delete a folder another live job is writing. So a claim is
*live* unless it is provably stale: on this host, its process is gone (or is this one);
on another host, it names this job (the restarted job carries on its own save) or is
older than `STALE_S`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from unbroken.errors import CheckpointError
from unbroken.format.layout import step_dir
from unbroken.memory.paths import process_exists
from unbroken.storage import Storage

CLAIM = "claim.json"
STALE_S = 3600.0  # a claim from another host older than this is a crashed save's


@dataclass(frozen=True)
class Claim:
    job: str
    host: str
    pid: int
    created: float

    @classmethod
    def here(cls, job: str) -> Claim:
        return cls(job, socket.gethostname(), os.getpid(), time.time())

    def live(self, job: str | None) -> bool:
        """Whether another writer may still be saving under this claim, as seen by
        ``job`` (None: any job)."""
        if self.host == socket.gethostname():
            return self.pid != os.getpid() and process_exists(self.pid)
        return self.job != job and time.time() - self.created < STALE_S

    def ours(self) -> bool:
        """Whether this process staked it."""
        return (self.host, self.pid) == (socket.gethostname(), os.getpid())

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        return f"job {self.job!r}, pid {self.pid} on {self.host}, since {when}"


def read(storage: Storage, folder: str) -> Claim | None:
    """The claim in ``folder``, or None if there is none (or it cannot be parsed)."""
    try:
        data = json.loads(storage.read(f"{folder}/{CLAIM}"))
        return Claim(str(data["job"]), str(data["host"]), int(data["pid"]), float(data["created"]))
    except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError):
        return None


def stake(storage: Storage, where: str, step: int, job: str) -> None:
    """Claim ``step`` for ``job`` before writing it; `CheckpointError` if another live
    writer holds it. A stale claim (see the module docstring) is taken over."""
    folder = step_dir(step)
    mine = json.dumps(asdict(Claim.here(job))).encode()
    for attempt in range(3):
        try:
            storage.commit(f"{folder}/{CLAIM}", mine)
            return
        except FileExistsError:
            break
        except FileNotFoundError:  # another job's first pass removed the empty folder
            if attempt == 2:
                raise CheckpointError(
                    f"{where}: step {step}'s folder keeps vanishing: another job is "
                    "cleaning this path; two jobs must not save to one path"
                ) from None
    held = read(storage, folder)
    if held is not None and held.live(job):
        raise CheckpointError(
            f"{where}: step {step} is being saved by another writer ({held}); two jobs "
            f"must not save to one path: give each its own, or stop the other job"
        )
    storage.replace(f"{folder}/{CLAIM}", mine)


def verify(storage: Storage, where: str, step: int) -> None:
    """Before committing ``step``: its claim is still this process's. If another job's
    first pass removed the folder meanwhile, files written before may be gone: refuse."""
    held = read(storage, step_dir(step))
    if held is None or not held.ours():
        raise CheckpointError(
            f"{where}: step {step}'s claim was removed or taken while saving it "
            f"({held or 'no claim'}); not committing: another job writes this path"
        )
