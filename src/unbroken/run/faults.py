"""Fault specs for ``unbroken run --inject-fault`` (and ``$UNBROKEN_INJECT_FAULT``)::

    kill rank=1 step=40        rank 1 SIGKILLs itself once it reaches step 40
    hang rank=0 step=60        rank 0 stops making progress forever
    kill-node node=1 step=80   simulated node 1 dies: all its ranks and its memory
    crash point=manifest-commit rank=0 hit=2
                               rank 0 SIGKILLs itself the 2nd time it reaches the
                               crash point ``manifest-commit`` (rank=: any rank if
                               omitted; hit=: 1 if omitted)

Several are ``;``-separated. The worker side fires kill, hang and kill-node
(`unbroken.run.worker`); crash faults fire in the library itself, at the crash points
(`point`), which cost one dictionary lookup when no crash fault is set.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

KINDS = {"kill": "rank", "hang": "rank", "kill-node": "node", "crash": "rank"}
EXAMPLES = (
    "'kill rank=1 step=40', 'hang rank=0 step=60', 'kill-node node=1 step=80' "
    "or 'crash point=manifest-commit rank=0 hit=2'"
)

# The crash points, in the order a save, a snapshot or a restore reaches them: the
# file that calls `point` with each name is listed in docs/guarantees.md.
POINTS = (
    "stage",  # saving.stage: the state captured, before the staging copy
    "data-write",  # shards.write_blocks: before a shard file is written
    "fsync",  # storage/local.py: a shard's bytes written, before its fsync
    "data-written",  # saving: every rank's data durable, before the manifest
    "manifest-commit",  # directory.commit: before the manifest is published
    "committed",  # saving: the manifest published, before the latest pointer moves
    "latest-pointer",  # directory.move_latest: before the pointer is replaced
    "retention-gc",  # directory.delete: a step's manifest gone, its files not yet
    "leftover-clear",  # collector: before a crashed save's leftovers are removed
    "snapshot-copy",  # snapshots.take: state copied into a slot, not yet sealed
    "snapshot-seal",  # snapshots: checksummed, before the slot is published
    "replica-transfer",  # replicas.replicate: the bytes received, not yet published
    "replica-published",  # replicas.replicate: published, before the ranks agree
    "heal",  # healing.heal: the plan agreed, before the transfers
    "step-gradients",  # healing.stepper: the step's gradients exchanged, not yet prepared
    "step-prepared",  # healing.stepper: prepared and past the barrier, not yet applied
    "step-applied",  # healing.stepper: applied, its record not yet sent
)


@dataclass(frozen=True)
class Fault:
    """One fault to inject: ``kind`` at ``step`` on ``target`` (a rank, or a node for
    kill-node). ``index`` is its position in the launch's list: it fires once per launch."""

    kind: str
    target: int  # -1: any rank (crash faults only)
    step: int  # for crash faults: the hit (1: the first time the point is reached)
    index: int = 0
    point: str = ""  # crash faults only

    def __str__(self) -> str:
        if self.kind == "crash":
            rank = "" if self.target < 0 else f" rank={self.target}"
            return f"crash point={self.point}{rank} hit={self.step}"
        return f"{self.kind} {KINDS[self.kind]}={self.target} step={self.step}"


def parse(spec: str) -> list[Fault]:
    """Parse ``;``-separated faults; a ValueError names the text that is wrong."""
    faults: list[Fault] = []
    for text in (part.strip() for part in spec.split(";")):
        if text:
            faults.append(_parse_one(text, len(faults)))
    return faults


def _parse_one(text: str, index: int) -> Fault:
    def bad(why: str) -> ValueError:
        return ValueError(f"bad fault {text!r}: {why}; write e.g. {EXAMPLES}")

    kind, *pairs = text.split()  # text is not blank: parse() skips those
    if kind not in KINDS:
        raise bad(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
    if kind == "crash":
        return _parse_crash(pairs, index, bad)
    values: dict[str, int] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not re.fullmatch(r"\d+", value):
            raise bad(f"{pair!r} is not key=N with N a non-negative integer")
        if key not in (KINDS[kind], "step"):
            raise bad(f"{kind} takes {KINDS[kind]}= and step=, not {key}=")
        if key in values:
            raise bad(f"{key}= given twice")
        values[key] = int(value)
    missing = [k for k in (KINDS[kind], "step") if k not in values]
    if missing:
        raise bad(f"missing {' and '.join(k + '=' for k in missing)}")
    return Fault(kind, values[KINDS[kind]], values["step"], index)


def _parse_crash(pairs: list[str], index: int, bad: Callable[[str], ValueError]) -> Fault:
    values: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if key not in ("point", "rank", "hit") or not eq:
            raise bad(f"crash takes point=NAME, rank=N and hit=N, not {pair!r}")
        if key in values:
            raise bad(f"{key}= given twice")
        if key != "point" and not re.fullmatch(r"\d+", value):
            raise bad(f"{pair!r} is not {key}=N with N a non-negative integer")
        values[key] = value
    point_name = values.get("point")
    if point_name not in POINTS:
        raise bad(f"crash needs point= one of {', '.join(POINTS)}")
    hit = int(values.get("hit", "1"))
    if hit < 1:
        raise bad("hit= counts from 1")
    return Fault("crash", int(values.get("rank", "-1")), hit, index, point_name)


# -- crash points ----------------------------------------------------------------------

_armed: dict[str, list[Fault]] | None = None  # None: not read from the environment yet
_hits: dict[str, int] = {}
_lock = threading.Lock()


def arm(spec: str, rank: int | None = None) -> None:
    """Arm the crash faults of ``spec`` (the others are ignored here) for this process,
    as ``rank`` (default ``$RANK``), replacing any armed before; ``""`` disarms. Hits
    are counted from now on. `unbroken run` arms ``$UNBROKEN_INJECT_FAULT`` on the
    first attempt; tests call this directly."""
    global _armed
    me = int(os.environ.get("RANK", "0")) if rank is None else rank
    armed: dict[str, list[Fault]] = {}
    for fault in parse(spec):
        if fault.kind == "crash" and fault.target in (-1, me):
            armed.setdefault(fault.point, []).append(fault)
    with _lock:
        _armed = armed
        _hits.clear()


def point(name: str) -> None:
    """Crash point ``name`` (one of `POINTS`) is reached: SIGKILL this process if an
    armed crash fault says so. Costs a dictionary lookup when none is armed."""
    armed = _armed
    if armed is None:
        _arm_from_env()
        armed = _armed or {}
    if not armed or name not in armed:
        return
    with _lock:
        hit = _hits[name] = _hits.get(name, 0) + 1
    if any(fault.step == hit for fault in armed[name]):
        _crash(name, hit)


def _arm_from_env() -> None:
    from unbroken.run import contract  # the names shared with the launcher

    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    arm(os.environ.get(contract.FAULT_ENV, "") if first else "")


# Called before a crash point kills: `unbroken.run.worker` records the event here (it
# imports this module, so this one cannot import it).
BEFORE_CRASH: list[Callable[[str, int], None]] = []


def _crash(name: str, hit: int) -> None:
    for hook in BEFORE_CRASH:
        hook(name, hit)
    os.kill(os.getpid(), signal.SIGKILL)
