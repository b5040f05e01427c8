"""Goodput arithmetic: every second of a launch, on every rank, given to one cause.

From a run directory's events (`unbroken.run.rundir.read`), each rank's time from
the launch to the end is cut into labelled intervals:

* ``productive``: a step's span (from the previous step or event to its tick), for the
  last execution of each step number;
* ``recompute``: a step's span that was later executed again (its work was lost), and
  the time from a rank's last step to a failure (work in flight, lost). The spans a kill
  took from the log are rebuilt from the step each process last reached
  (`unbroken.goodput.lost`);
* ``checkpoint``: a blocking save or a snapshot (`save_start`..`save_end`,
  `snapshot_start`..`snapshot_end`); a save cut short by a failure ends at the failure;
* ``detection``: from a failure to its detection by the launcher;
* ``restart``: from the detection to the rank's next process (or attempt) starting;
* ``init``: from a process start (for the first, from the launch) to its restore, data
  warm-up or first step: interpreter, imports, process group, model building;
* ``restore``: `restore_start`..`restore_done`;
* ``data``: data warm-up, up to `data_ready` (its ``seconds`` field, or since the
  previous event);
* ``other``: anything else (the end of the run after the last step, for one).

Where intervals overlap, the first in `PRIORITY` wins: a blocking save inside a step's
span is checkpoint time, not step time. Background persists (`persist_start` ..
`persist_end`) overlap training and are reported apart (``persist_s``), not as badput.
The job's figures are the mean over ranks. Failures, injected or real, are those of
`unbroken.run.timeline.failures`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from unbroken.goodput import lost
from unbroken.run.timeline import DETECTIONS, failures

Event = dict[str, Any]
Interval = tuple[float, float, str]
PRIORITY = (
    "checkpoint",
    "restore",
    "data",
    "init",
    "detection",
    "restart",
    "recompute",
    "productive",
)
CAUSES = {
    "checkpoint": "checkpoint stall",
    "detection": "failure detection",
    "restart": "restart",
    "init": "initialisation",
    "restore": "restore",
    "recompute": "recomputation",
    "data": "data warm-up",
    "other": "other",
}
PAIRS = {
    "save_start": ("save_end", "checkpoint"),
    "snapshot_start": ("snapshot_end", "checkpoint"),
    "restore_start": ("restore_done", "restore"),
    "persist_start": ("persist_end", "persist"),
}


@dataclass
class Account:
    """A launch's time by cause; seconds are means over ranks, times since ``t0``."""

    t0: float
    wall_s: float
    ranks: list[int]
    seconds: dict[str, float]  # "productive" and each of CAUSES
    failures: list[Event]
    steps_recomputed: int
    persist_s: float
    segments: dict[int, list[Interval]] = field(default_factory=dict)  # per rank

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The figures, for dashboards (`unbroken goodput --json`)."""
        return {
            "wall_s": round(self.wall_s, 3),
            "goodput": round(self.goodput, 6),
            "productive_s": round(self.seconds["productive"], 3),
            "badput_s": {k: round(self.seconds[k], 3) for k in CAUSES},
            "ranks": self.ranks,
            "failures": self.failures,
            "steps_recomputed": self.steps_recomputed,
            "background_persist_s": round(self.persist_s, 3),
        }


def account(events: list[Event]) -> Account:
    """Every second of the launch whose ``events`` (any order) are given, by cause."""
    events = sorted(lost.restore(events), key=lambda e: e["t"])
    ranks = sorted({e["rank"] for e in events if "pid" in e and e.get("rank") is not None})
    if not ranks:
        raise ValueError("no worker events: nothing to account for")
    t0 = next((e["t"] for e in events if e["event"] == "launch"), None)
    if t0 is None:
        t0 = min(_began(e) for e in events)
    t1 = max(_end(e) for e in events)
    failed = _failures(events)
    per_rank = {r: _rank(events, r, failed, t0, t1) for r in ranks}
    seconds = {k: sum(p[0][k] for p in per_rank.values()) / len(ranks) for k in _LABELS}
    return Account(
        t0=t0,
        wall_s=t1 - t0,
        ranks=ranks,
        seconds=seconds,
        failures=[_public(f, t0) for f in failed],
        steps_recomputed=max(p[1] for p in per_rank.values()),
        persist_s=sum(p[2] for p in per_rank.values()) / len(ranks),
        segments={r: [(a - t0, b - t0, k) for a, b, k in p[3]] for r, p in per_rank.items()},
    )


_LABELS = ("productive", *CAUSES)


def _began(e: Event) -> float:
    """When a process began, for its ``process_start`` event; else the event's time."""
    return e["t"] if e.get("process_start") is None else e["process_start"]


def _end(e: Event) -> float:
    return e["spans"][-1][2] if e["event"] == "steps" and e["spans"] else e["t"]


def _failures(events: list[Event]) -> list[Event]:
    """Failures with their detection time (``detected``; None if none was seen)."""
    last: dict[int, tuple[int, float]] = {}
    for e in events:
        if e["event"] == "steps" and e["spans"]:
            last[e["pid"]] = (e["spans"][-1][0], e["spans"][-1][2])
    out = []
    for f in failures(events, last):
        seen = (e["t"] for e in events if e["event"] in DETECTIONS and e["t"] >= f["t"])
        out.append({**f, "detected": next(seen, None)})
    return sorted(out + _silent_ends(events, out, last), key=lambda f: f["t"])


def _silent_ends(
    events: list[Event], known: list[Event], last: dict[int, tuple[int, float]]
) -> list[Event]:
    """Processes that stopped with no failure on record (a launcher that keeps no log,
    such as plain torchrun, or one killed with its job): a rank's process whose next
    process started with no known failure since the first one started. Dated to its last
    sign of life, never detected."""
    procs: dict[tuple[int, int], list[float]] = {}  # (rank, pid) -> [start, last seen]
    for e in events:
        if "pid" in e and e.get("rank") is not None and e["event"] not in DETECTIONS:
            span = procs.setdefault((e["rank"], e["pid"]), [_began(e), 0.0])
            span[1] = max(span[1], _end(e))
    out: list[Event] = []
    by_rank = sorted(procs.items(), key=lambda kv: (kv[0][0], kv[1][0]))
    for ((rank, pid), (start, seen)), ((rank2, _), (start2, _)) in pairwise(by_rank):
        if rank != rank2 or any(start < f["t"] < start2 for f in known + out):
            continue
        what = f"real failure: rank {rank}'s process stopped (no launcher record)"
        step = last.get(pid, (None, 0.0))[0]
        out.append({"event": "fault", "t": seen, "spec": what, "step": step, "real": True,
                    "detected": None})  # fmt: skip
    return out


def _public(f: Event, t0: float) -> Event:
    detected = None if f["detected"] is None else round(f["detected"] - t0, 4)
    what = f["spec"] if f.get("real") else f"fault: {f['spec']}"
    return {"what": what, "t": round(f["t"] - t0, 4), "step": f["step"], "detected_t": detected}


def _rank(
    events: list[Event], rank: int, failed: list[Event], t0: float, t1: float
) -> tuple[dict[str, float], int, float, list[Interval]]:
    """One rank's seconds by label, steps recomputed, persist seconds, segments."""
    mine = [e for e in events if e.get("rank") == rank and "pid" in e]
    spans, recomputed = _spans(mine)
    paired = _paired(mine, failed, t1)
    persist = [(a, b, k) for a, b, k in paired if k == "persist"]
    intervals = spans + [i for i in paired if i[2] != "persist"] + _setup(mine, t0)
    intervals += _failure_intervals(mine, failed, t1)
    for f in failed:  # work since the rank's last step before the failure: lost, redone
        last = max((b for _, b, _ in spans if b <= f["t"]), default=None)
        if last is not None:
            intervals.append((last, f["t"], "recompute"))
    seconds, segments = _sweep(intervals, t0, t1)
    return seconds, recomputed, _union(persist), segments


def _spans(mine: list[Event]) -> tuple[list[Interval], int]:
    """Step spans: the last execution of each step is productive, earlier ones were
    recomputed."""
    spans = sorted(
        (s for e in mine if e["event"] == "steps" for s in e["spans"]), key=lambda s: s[2]
    )
    last = {s[0]: i for i, s in enumerate(spans)}
    out = [
        (a, b, "productive" if last[step] == i else "recompute")
        for i, (step, a, b) in enumerate(spans)
    ]
    return out, len(spans) - len(last)


def _paired(mine: list[Event], failed: list[Event], t1: float) -> list[Interval]:
    """Start/end pairs per process; a start with no end ends at the next failure (or
    the process's last event); data warm-up ends at `data_ready`."""
    out: list[Interval] = []
    by_pid: dict[int, list[Event]] = defaultdict(list)
    for e in mine:
        by_pid[e["pid"]].append(e)
    for evs in by_pid.values():
        open_: dict[tuple[str, Any], float] = {}  # (start event, step) -> when
        mark = evs[0]["t"]
        for e in evs:
            name = e["event"]
            if name in PAIRS and e.get("background", True):  # blocking: inside a save
                open_[(name, e.get("step"))] = e["t"]
            for start, (end, label) in PAIRS.items():
                key = (start, e.get("step"))
                if name == end and key not in open_:  # no step given: the oldest
                    key = next((k for k in open_ if k[0] == start), key)
                if name == end and key in open_:
                    out.append((open_.pop(key), e["t"], label))
            if name == "data_ready":
                begin = e["t"] - e["seconds"] if e.get("seconds") is not None else mark
                out.append((begin, e["t"], "data"))
            if name in ("process_start", "init_done", "restore_done", "data_ready"):
                mark = e["t"]
        last = max(_end(e) for e in evs)
        for (start, _), t in open_.items():
            stop = min((f["t"] for f in failed if f["t"] >= t), default=last)
            out.append((t, stop, PAIRS[start][1]))
    return out


def _segments(mine: list[Event]) -> list[tuple[float, list[Event]]]:
    """Each (process, attempt) of the rank: when it started, and its events."""
    groups: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in mine:
        groups[(e["pid"], e.get("attempt", 0))].append(e)
    out = []
    for evs in groups.values():
        start = next((_began(e) for e in evs if e.get("process_start") is not None), None)
        out.append((evs[0]["t"] if start is None else start, evs))
    return sorted(out, key=lambda s: s[0])


def _setup(mine: list[Event], t0: float) -> list[Interval]:
    """Initialisation: each process (or attempt) from its start to its restore, data
    warm-up or first step; the first from the launch."""
    out: list[Interval] = []
    for i, (start, evs) in enumerate(_segments(mine)):
        ends = [e["t"] for e in evs if e["event"] == "restore_start"]
        ends += [e["t"] - (e.get("seconds") or 0) for e in evs if e["event"] == "data_ready"]
        ends += [e["spans"][0][1] for e in evs if e["event"] == "steps" and e["spans"]]
        end = min(ends, default=max(_end(e) for e in evs))
        out.append((t0 if i == 0 else start, end, "init"))
    return out


def _failure_intervals(mine: list[Event], failed: list[Event], t1: float) -> list[Interval]:
    """Per failure: detection, then restart until the rank's next process or attempt."""
    starts = [s for s, _ in _segments(mine)]
    out: list[Interval] = []
    for f in failed:
        detected = f["t"] if f["detected"] is None else f["detected"]
        out.append((f["t"], detected, "detection"))
        nxt = min((s for s in starts if s > f["t"]), default=t1)
        out.append((detected, max(nxt, detected), "restart"))
    return out


def _sweep(
    intervals: list[Interval], t0: float, t1: float
) -> tuple[dict[str, float], list[Interval]]:
    """Each instant in [t0, t1] goes to the highest-priority interval covering it."""
    rank_of = {k: i for i, k in enumerate(PRIORITY)}
    points: list[tuple[float, int, int]] = [(t0, 0, -1), (t1, 0, -1)]
    for a, b, label in intervals:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            points += [(a, 1, rank_of[label]), (b, -1, rank_of[label])]
    points.sort()
    counts = [0] * len(PRIORITY)
    seconds = dict.fromkeys(_LABELS, 0.0)
    segments: list[Interval] = []
    prev = t0
    for t, delta, k in points:
        if t > prev:
            label = next((PRIORITY[i] for i, c in enumerate(counts) if c > 0), "other")
            seconds[label] += t - prev
            if segments and segments[-1][2] == label and segments[-1][1] == prev:
                segments[-1] = (segments[-1][0], t, label)
            else:
                segments.append((prev, t, label))
            prev = t
        if k >= 0:
            counts[k] += delta
    return seconds, segments


def _union(intervals: list[Interval]) -> float:
    total, end = 0.0, float("-inf")
    for a, b, _ in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
