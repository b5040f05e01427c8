"""The last step each process reached, kept where a SIGKILL cannot take it.

A worker buffers its step spans and writes them at most once a second
(`unbroken.run.worker`): a process killed without warning (a SIGKILL from outside, the
OOM killer, ``os._exit``, torchrun stopping the ranks of a failed attempt) takes the
spans since its last write with it, and with them the steps a restart computes again.
So each span also goes, as one small record (`Record`), into ``reached-<RANK>-<PID>``
next to the process's event log (`contract.reached_file`), through a shared memory
map of that file: a memory copy per step, no system call. The kernel's page cache holds
the mapped page whatever becomes of the process (not of the machine: like the event
log, it is never fsynced). `unbroken goodput` reads the records (`read`, through
`unbroken.run.rundir.read`) to count the steps a kill lost (`unbroken.goodput.lost`).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

from unbroken.access import Access
from unbroken.run import contract

# step, end of its span (wall clock), attempt, the step again: a record read while it
# is being written (a report on a live run) has two different steps, and is skipped.
LAYOUT = struct.Struct("<qdqq")


class Record(NamedTuple):
    step: int
    t: float  # when the step ended: its tick, wall clock
    attempt: int


class Reached:
    """This process's record, for ``rank``, in ``directory``; the file is made and
    mapped at the first `note`, by the process that ticks."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self.directory = directory
        self.rank = rank
        self.map: mmap.mmap | None = None

    def note(self, step: int, t: float, attempt: int) -> None:
        """Record that ``step`` of ``attempt`` ended at ``t``: about 0.2 µs."""
        if self.map is None:
            self.map = self._open()
        LAYOUT.pack_into(self.map, 0, step, t, attempt, step)

    def _open(self) -> mmap.mmap:
        assert self.directory is not None
        access = Access.from_env()
        access.makedirs(self.directory)
        path = os.path.join(self.directory, contract.reached_file(self.rank, os.getpid()))
        # Reserved, not sparse: on a full disk this raises now, not a SIGBUS mid-step.
        access.size(path, mmap.PAGESIZE)
        fd = access.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, mmap.PAGESIZE)  # shared: what it holds is the file's
        finally:
            os.close(fd)


def read(directory: str | Path) -> list[dict[str, Any]]:
    """Each process's record in ``directory``, as a ``reached`` event (``t``: when the
    step ended; ``step``, ``rank``, ``pid``, ``attempt``). Files never written, cut
    short or caught mid-write are skipped."""
    out = []
    for path in sorted(Path(directory).glob(f"{contract.REACHED_PREFIX}*")):
        rank, _, pid = path.name[len(contract.REACHED_PREFIX) :].partition("-")
        try:
            step, t, attempt, check = LAYOUT.unpack_from(path.read_bytes())
            who = {"rank": int(rank), "pid": int(pid)}
        except (OSError, ValueError, struct.error):
            continue
        if step == check and t > 0:
            out.append({"event": "reached", "t": t, "step": step, "attempt": attempt, **who})
    return out
