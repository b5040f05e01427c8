"""The recovery timeline of a launch: events from the launcher and its workers, and per
injected fault, when it was detected, recovered from, and how many steps were redone.

One `Timeline` serves both modes; its ``mode`` picks how events become recoveries:
``"restart"`` (torchrun restarts every worker: new processes after the fault) or
``"in-process"`` (a new generation: respawned ranks, healthy ones kept).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

Event = dict[str, Any]
Recovery = dict[str, Any]
Mode = Literal["restart", "in-process"]
DETECTIONS = ("worker_exit", "hang_detected", "node_kill_requested")


def say(message: str) -> None:
    print(f"unbroken run: {message}", file=sys.stderr, flush=True)


@dataclass
class Timeline:
    t0: float = field(default_factory=time.time)
    events: list[Event] = field(default_factory=list)
    mode: Mode = "restart"

    def add(
        self, event: str, message: str | None = None, t: float | None = None, **kw: Any
    ) -> None:
        """Record ``event`` at ``t`` (wall clock; now if None), and print ``message``."""
        when = time.time() if t is None else t
        self.events.append({"event": event, "t": round(when - self.t0, 4), **kw})
        if message is not None:
            say(f"[{when - self.t0:7.2f} s] {message}")

    def recoveries(self) -> list[Recovery]:
        """One per injected fault, in order (see `restart_recoveries` and
        `in_process_recoveries` for what each holds)."""
        events = sorted(self.events, key=lambda e: e["t"])
        if self.mode == "in-process":
            return in_process_recoveries(events)
        return restart_recoveries(events)

    def to_json(self, exit_code: int) -> dict[str, Any]:
        return {
            "t0": self.t0,
            "exit_code": exit_code,
            "events": sorted(self.events, key=lambda e: e["t"]),
            "recoveries": self.recoveries(),
        }

    def summary(self) -> str:
        in_process = self.mode == "in-process"
        title = "timeline (seconds since launch)"
        lines = [f"{title}, in-process recovery:" if in_process else f"{title}:"]
        phases = _in_process_phases if in_process else _restart_phases
        for r in self.recoveries():
            lines += _recovery_lines(r, phases(r))
        if len(lines) == 1:
            lines.append("  no fault was injected")
        return "\n".join(lines)


def _recovery_lines(r: Recovery, phases: list[tuple[str, str]]) -> list[str]:
    def at(key: str) -> str:
        return "   -   " if r[key] is None else f"{r[key]:7.2f}"

    lines = [
        f"  {at('fault_t')}  fault: {r['fault']} at step {r['fault_step']}",
        f"  {at('detected_t')}  detected ({r['detected_by']})",
        *(f"  {at(key)}  {what}" for key, what in phases),
    ]
    if "recovery_s" in r:
        lines.append(
            f"           recovery {r['recovery_s']:.2f} s from fault to first step; "
            f"{r['steps_redone']} step(s) redone"
        )
    return lines


def _detection(fault: Event, after: list[Event]) -> Recovery:
    """What every recovery starts with: the fault, and the first sign of it."""
    detected = next((e for e in after if e["event"] in DETECTIONS), None)
    return {
        "fault": fault["spec"],
        "fault_t": fault["t"],
        "fault_step": fault["step"],
        "detected_t": None if detected is None else detected["t"],
        "detected_by": None if detected is None else detected["event"],
    }


def _finish(rec: Recovery, fault: Event) -> Recovery:
    if rec["first_step_t"] is not None:
        rec["recovery_s"] = round(rec["first_step_t"] - fault["t"], 4)
        rec["steps_redone"] = fault["step"] - rec["first_step"] + 1
    return rec


# -- restart-all (torchrun) -------------------------------------------------------------


def restart_recoveries(events: list[Event]) -> list[Recovery]:
    """Per injected fault: when it happened, was detected, workers restarted, the
    process group was ready again, and every rank had completed a step again."""
    out = []
    faults = [e for e in events if e["event"] == "fault"]
    # Processes that started after the fault: the restarted (or replacement) ones.
    starts = {
        e["pid"]: e["t"] if e.get("process_start") is None else e["process_start"]
        for e in events
        if e["event"] == "process_start"
    }
    for i, fault in enumerate(faults):
        t = fault["t"]
        until = faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")
        # Before the next fault, unless both struck before any restart.
        new = {pid for pid, start in starts.items() if t < start < until} or {
            pid for pid, start in starts.items() if start > t
        }
        ready = [e["t"] for e in events if e["event"] == "init_done" and e["pid"] in new]
        firsts = [e for e in events if e["event"] == "first_step" and e["pid"] in new]
        rec = _detection(fault, [e for e in events if e["t"] >= t])
        rec.update(
            restart_t=min((starts[p] for p in new), default=None),
            ready_t=max(ready) if ready else None,
            first_step_t=max(e["t"] for e in firsts) if firsts else None,
            first_step=min(e["step"] for e in firsts) if firsts else None,
        )
        out.append(_finish(rec, fault))
    return out


def _restart_phases(r: Recovery) -> list[tuple[str, str]]:
    """The summary's lines between detection and recovery: (time key, what)."""
    return [
        ("restart_t", "workers restarted (process start)"),
        ("ready_t", "process group ready"),
        ("first_step_t", f"first step after restart: step {r['first_step']}"),
    ]


# -- in-process -------------------------------------------------------------------------


def in_process_recoveries(events: list[Event]) -> list[Recovery]:
    """Per injected fault: detection, the new generation and respawn, the process
    group ready on every rank, the restore done on every rank, the first step."""
    out = []
    for fault in (e for e in events if e["event"] == "fault"):
        after = [e for e in events if e["t"] >= fault["t"]]
        rec = _detection(fault, after)
        bump = next((e for e in after if e["event"] == "generation"), None)
        g = None if bump is None else bump["generation"]
        mine = [e for e in after if e.get("attempt") == g and "rank" in e]
        firsts = [e for e in mine if e["event"] == "first_step"]
        respawns = [e for e in after if e["event"] == "respawn" and e["generation"] == g]
        rec.update(
            generation=g,
            respawned=sorted(e["rank"] for e in respawns),
            warm_spares=sum(bool(e["spare"]) for e in respawns),
            noticed_t=min(
                (e["t"] for e in after if e["event"] in ("peer_failure", "abort")),
                default=None,
            ),
            respawn_t=max((e["t"] for e in respawns), default=None),
            ready_t=_last(mine, "init_done"),
            restored_t=_last(mine, "restore_done"),
            first_step_t=_last(mine, "first_step"),
            first_step=min((e["step"] for e in firsts), default=None),
        )
        out.append(_finish(rec, fault))
    return out


def _last(events: list[Event], name: str) -> float | None:
    """When the last of ``events`` named ``name`` happened."""
    return max((e["t"] for e in events if e["event"] == name), default=None)


def _in_process_phases(r: Recovery) -> list[tuple[str, str]]:
    how = f"{r['warm_spares']} from warm spares" if r["warm_spares"] else "cold start"
    respawn = f"generation {r['generation']}: ranks {r['respawned']} respawned ({how})"
    return [
        ("noticed_t", "a healthy rank aborted its groups"),
        ("respawn_t", respawn),
        ("ready_t", "process group ready on every rank"),
        ("restored_t", "restore done on every rank"),
        ("first_step_t", f"first step after recovery: step {r['first_step']}"),
    ]
