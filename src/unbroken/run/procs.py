"""Process trees, read from /proc: kill one whole, list it, tell a live process from a
dead one, read the CPU time one used."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Protocol


class Process(Protocol):
    """What the launchers use of a process they started: `subprocess.Popen`, or a spare
    forked by another process (`unbroken.run.template.Forked`)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every process below it, like a machine losing power.

    torchrun starts workers in sessions of their own, so the tree is collected first
    (from /proc) and every process in it is killed, with each process group it leads.
    A group led by a live process outside the tree is spared: a spare forked by a
    template is in the template's group until it takes its own session, and killing
    that group would kill the template and every rank it forked."""
    pids = [pid, *descendants(pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(p)
            if group in pids or not alive(group):
                os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    return pids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: children, their children, and so on."""
    return _below(_children(), [pid])


def trees(roots: list[int]) -> list[int]:
    """``roots`` and every process below them, from one read of /proc."""
    return [*roots, *_below(_children(), roots)]


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(stat.parent.name))
    return children


def _below(children: dict[int, list[int]], roots: list[int]) -> list[int]:
    found, todo = [], list(roots)
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    """Running: exists and is not a zombie (a dead worker torchrun has not reaped yet)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: it runs nothing until continued."""
    fields = _stat(pid)
    return fields is not None and fields[0] in ("T", "t")


def rank_of(pid: int) -> int | None:
    """The ``RANK`` ``pid`` was started with (torchrun's workers, cold ranks); None if none."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    found = [item[5:] for item in items if item.startswith(b"RANK=")]
    return int(found[0]) if found and found[0].isdigit() else None


def cpu_ticks(pid: int) -> int | None:
    """The CPU time ``pid`` used so far (user and system, in clock ticks); None if gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[11]) + int(fields[12])


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
