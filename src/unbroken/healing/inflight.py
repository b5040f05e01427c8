"""The step in flight: no moment of a step at which a lost rank costs a step.

A step's record (`unbroken.healing.records`) is made and sent in `Checkpointer.step`,
after the optimizer applied the step. A rank lost between its gradient exchange and
that record would leave the survivors one step ahead of the newest record anyone holds
of it: they cannot go back, it cannot be rebuilt, and the job fell back to snapshots,
losing the step. So, as the optimizer is about to apply step s (a step pre-hook of
every optimizer in the state), each rank also

1. makes a *prepared* record of s (its per-rank state as the step leaves it, before
   whatever the loop updates after the optimizer) and sends it to its record peers, as
   `Checkpointer.step` sends the record, and
2. waits at a barrier on the default group (in program order with the step's own
   collectives) before any rank applies the step.

A rank lost before the barrier stops every survivor before the update: all are still at
s - 1, whose records are held, and s is redone (it was in flight). A rank lost after it
has delivered its prepared record: the survivors apply s, and its record of s is rebuilt
from the prepared one, each entry either as prepared (every live rank's entry is the same
before and after the update: RNG states, data positions) or as the live ranks hold it
after the update (an entry every rank held alike before it and every live rank holds
alike after it: `Progress`, schedulers). Any other entry (changed by the update, and
per rank) cannot be rebuilt: the heal falls back to snapshots, as before.

Not covered: a rank lost in the middle of the barrier itself can leave some survivors
past the update and others not; that falls back to snapshots. The barrier runs where the
default group is gloo; with NCCL it is skipped (records are still prepared).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from unbroken.errors import CheckpointError
from unbroken.healing import records
from unbroken.healing.records import Record

_lock = threading.Lock()
_own: dict[str, dict[int, Record]] = {}  # job -> after -> this process's prepared records
_held: dict[str, dict[int, dict[int, bytes]]] = {}  # job -> owner -> after -> prepared record


def keep_own(job: str, record: Record) -> None:
    with _lock:
        _keep(_own.setdefault(job, {}), record.after or 0, record)


def keep_held(job: str, owner: int, after: int, data: bytes) -> None:
    with _lock:
        _keep(_held.setdefault(job, {}).setdefault(owner, {}), after, data)


def _keep(by_after: dict[int, Any], after: int, value: Any) -> None:
    by_after[after] = value
    for old in sorted(by_after)[: -records.KEEP]:
        del by_after[old]


def forget(job: str) -> None:
    with _lock:
        _own.pop(job, None)
        _held.pop(job, None)


def row(job: str, rank: int, mine: Record | None) -> dict[str, Any] | None:
    """This rank's part of the heal's plan row: the step before its newest record
    (``after``), the digests of that record (``post``) and of its prepared record of the
    same step (``pre``), and those of the prepared records it holds for peers."""
    if mine is None or mine.after is None:
        return None
    with _lock:
        pre = _own.get(job, {}).get(mine.after)
        held = {o: dict(a) for o, a in _held.get(job, {}).items()}
    peers = {}
    for owner, by_after in held.items():
        if mine.after in by_after:
            try:
                peers[str(owner)] = Record.decode(by_after[mine.after], f"rank {owner}").header
            except CheckpointError:
                continue  # malformed: this rank cannot heal it from that record
    return {
        "after": mine.after,
        "post": mine.header.get("digests"),
        "pre": None if pre is None or pre.rank != rank else pre.header.get("digests"),
        "held": {o: h.get("digests") for o, h in peers.items() if h.get("after") == mine.after},
    }


def rebuild(
    table: list[dict[str, Any]], live: list[int], lost: int
) -> tuple[int, list[str]] | None:
    """Pure: for a lost rank whose record of the heal's step no one holds, the live rank
    holding its prepared record and the entries to take from the live ranks' records, if
    every entry can be rebuilt (module docstring); else None."""
    rows = [table[q].get("flight") for q in live]
    flights: list[dict[str, Any]] = [f for f in rows if f is not None and f["pre"] is not None]
    if len(flights) != len(live) or len({f["after"] for f in flights}) != 1:
        return None
    holders = [q for q, f in zip(live, flights, strict=True) if str(lost) in f["held"]]
    if not holders:
        return None
    prepared: Mapping[str, str] = flights[live.index(holders[0])]["held"][str(lost)]
    names = set(prepared)
    if any(set(f["post"]) != names or set(f["pre"]) != names for f in flights):
        return None
    common = []
    for name in sorted(names):
        if all(f["post"][name] == f["pre"][name] for f in flights):
            continue  # untouched by the update: as prepared
        before = {f["pre"][name] for f in flights} | {prepared[name]}
        if len({f["post"][name] for f in flights}) == 1 and len(before) == 1:
            common.append(name)  # the same everywhere, before and after the update
            continue
        return None
    return holders[0], common


def merged(job: str, rank: int, owner: int, after: int, common: list[str]) -> bytes:
    """On ``rank``, the holder of ``owner``'s prepared record: ``owner``'s record of the
    step after ``after``, rebuilt (`rebuild`) with the ``common`` entries of this rank's
    own newest record."""
    from unbroken.state import decode

    with _lock:
        data = _held[job][owner][after]
    prepared = Record.decode(data, f"rank {owner}")
    mine = records.own(job, rank)
    assert mine is not None and mine.after == after
    values: dict[str, Any] = {}
    for source in (prepared, mine):
        tensors = source.tensors()
        for name, encoded in source.header["tree"].items():
            if (source is mine) == (name in common):
                values[name] = decode(encoded, tensors)
    extra = {k: prepared.header[k] for k in ("layouts", "data_parallel") if k in prepared.header}
    return Record.make(mine.step, owner, values, fingerprinted=False, after=after, **extra).data
