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

A rank lost in the middle of the barrier can leave the survivors split: gloo's barrier
completes on the ranks that heard from every peer before the loss and fails on the
others, so some survivors applied s and some are still at s - 1. The heal rolls the ones
behind forward, never the others back: each receives the replicated state of s from a
rank that applied it, as a replacement does, and its record of s is rebuilt from its own
prepared record by the same rule. The barrier runs where the default group is gloo; with
NCCL it is skipped (records are still prepared).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from unbroken.errors import CheckpointError
from unbroken.healing import records
from unbroken.healing.records import Record
from unbroken.tree import decode

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
    same step (``pre``), those of the prepared records it holds for peers (``held``), and
    the same two for the step after its newest record (``next``: a rank stopped in the
    barrier of a step others applied)."""
    if mine is None or mine.after is None:
        return None
    own, held = _prepared(job, rank, mine.after)
    next_own, next_held = _prepared(job, rank, mine.step)
    return {
        "after": mine.after,
        "post": mine.header.get("digests"),
        "pre": own,
        "held": held,
        "next": {"own": next_own, "held": next_held},
    }


def _prepared(job: str, rank: int, after: int) -> tuple[Any, dict[str, Any]]:
    """The digests of this rank's own prepared record of the step after ``after`` (None
    if it has none), and of those it holds for peers, by owner."""
    with _lock:
        own = _own.get(job, {}).get(after)
        held = {o: a[after] for o, a in _held.get(job, {}).items() if after in a}
    peers = {}
    for owner, data in held.items():
        try:
            header = Record.decode(data, f"rank {owner}").header
        except CheckpointError:
            continue  # malformed: this rank cannot heal it from that record
        if header.get("after") == after:
            peers[str(owner)] = header.get("digests")
    return (None if own is None or own.rank != rank else own.header.get("digests")), peers


def rebuild(
    table: list[dict[str, Any]], ahead: list[int], lost: int
) -> tuple[int, list[str]] | None:
    """Pure: for a rank whose record of the heal's step no one holds (lost, or alive and
    a step behind ``ahead``, the ranks live at it), the rank holding its prepared record
    and the entries to take from the ahead ranks' records, if every entry can be rebuilt
    (module docstring); else None."""
    rows = [table[q].get("flight") for q in ahead]
    flights: list[dict[str, Any]] = [f for f in rows if f is not None and f["pre"] is not None]
    if len(flights) != len(ahead) or len({f["after"] for f in flights}) != 1:
        return None
    found = _holder(table, ahead, flights, lost)
    if found is None:
        return None
    holder, prepared = found
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
    return holder, common


def _holder(
    table: list[dict[str, Any]], ahead: list[int], flights: list[dict[str, Any]], lost: int
) -> tuple[int, Mapping[str, str]] | None:
    """The first rank holding ``lost``'s prepared record of the heal's step, and its
    digests: a rank ahead, a rank behind (its ``next``), or ``lost`` itself if behind."""
    for q, f in zip(ahead, flights, strict=True):
        if str(lost) in f["held"]:
            return q, f["held"][str(lost)]
    after = flights[0]["after"]
    for q, row in enumerate(table):
        following = (row.get("flight") or {}).get("next")
        if row["live"] != after or following is None:
            continue
        prepared = following["own"] if q == lost else following["held"].get(str(lost))
        if prepared is not None:
            return q, prepared
    return None


def prepared(job: str, rank: int, owner: int, after: int) -> bytes:
    """On ``rank``: ``owner``'s prepared record of the step after ``after``, as held (its
    own, if ``owner`` is ``rank``)."""
    with _lock:
        if owner == rank:
            return _own[job][after].data
        return _held[job][owner][after]


def merge(prepared: Record, post: Record, common: list[str]) -> Record:
    """Pure: ``prepared``'s owner's record of its step, rebuilt (`rebuild`) with the
    ``common`` entries of ``post``, a record of the same step of a rank that applied it."""
    values: dict[str, Any] = {}
    for source in (prepared, post):
        tensors = source.tensors()
        for name, encoded in source.header["tree"].items():
            if (source is post) == (name in common):
                values[name] = decode(encoded, tensors)
    extra = {k: prepared.header[k] for k in ("layouts", "data_parallel") if k in prepared.header}
    return Record.make(
        post.step, prepared.rank, values, fingerprinted=False, after=prepared.after, **extra
    )
