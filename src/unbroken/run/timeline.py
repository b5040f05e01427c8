"""The recovery timeline of a launch: events from the launcher and its workers, and per
failure, when it was detected, recovered from, and how many steps were redone.

A failure is an injected fault, or a real one: a worker that exited, hung or lost its
node with no injected fault to explain it (`failures`). Real failures count as much as
injected ones. The launcher's own events also go, one JSON line each as they happen, to
``log`` (`contract.LAUNCHER_EVENTS` in the run directory), for `unbroken goodput`.

One `Timeline` serves both modes; its ``mode`` picks how events become recoveries:
``"restart"`` (torchrun restarts every worker: new processes after the fault) or
``"in-process"`` (a new generation: respawned ranks, healthy ones kept).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from unbroken.access import Access

Event = dict[str, Any]
Recovery = dict[str, Any]
Mode = Literal["restart", "in-process"]
# remote_failure: across machines, another node's failure as this node's agent read it
# from the generation's abort (`Timeline.remote_failure`).
DETECTIONS = ("worker_exit", "hang_detected", "node_kill_requested", "remote_failure")
NOTICED = ("peer_failure", "abort")  # a rank's events: it saw its generation fail


def say(message: str) -> None:
    print(f"unbroken run: {message}", file=sys.stderr, flush=True)


def first_line(error: BaseException) -> str:
    """An error's message for a one-line report (torch's store errors run to many)."""
    return next(iter(str(error).splitlines()), type(error).__name__)


@dataclass
class Timeline:
    t0: float = field(default_factory=time.time)
    events: list[Event] = field(default_factory=list)
    mode: Mode = "restart"

    log: str | None = None  # where the launcher's own events are appended
    last_step: dict[int, tuple[int, float]] = field(default_factory=dict)  # pid -> step, t

    def add(
        self, event: str, message: str | None = None, t: float | None = None, **kw: Any
    ) -> None:
        """Record the launcher's ``event`` at ``t`` (wall clock; now if None), print
        ``message``, and append it to `log`."""
        when = time.time() if t is None else t
        self.record(event, message, when, **kw)
        if self.log is not None:
            fd = Access.from_env().open(self.log, os.O_WRONLY | os.O_APPEND)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps({"event": event, "t": when, **kw}) + "\n")

    def record(self, event: str, message: str | None, t: float, **kw: Any) -> None:
        """Record ``event`` (a worker's, or the launcher's) at ``t``, wall clock."""
        self.events.append({"event": event, "t": round(t - self.t0, 4), **kw})
        if message is not None:
            say(f"[{t - self.t0:7.2f} s] {message}")

    def remote_failure(self, reason: dict[str, Any], generation: int) -> None:
        """Record another node's failure (``reason``: its generation's abort, across
        machines), dated at the first sign of it here: a local rank saw ``generation``
        fail. The summary then names it."""
        node, ranks, lost = reason["node"], reason.get("failed"), reason.get("lost")
        what = f"ranks {ranks} of node {node} failed"
        if lost or reason.get("hang"):
            what = f"node {node} lost" if lost else f"a rank of node {node} hung"
        mine = [e for e in self.events if e.get("attempt") == generation]
        first = min((e["t"] for e in mine if e["event"] in NOTICED), default=None)
        step = max((s for s, _ in self.last_step.values()), default=None)
        t = None if first is None else self.t0 + first
        message = f"{what} ({lost})" if lost else what
        self.add("remote_failure", message, t, node=node, what=what, step=step)

    def recoveries(self) -> list[Recovery]:
        """One per failure (`failures`), in order (see `restart_recoveries` and
        `in_process_recoveries` for what each holds)."""
        events = sorted(self.events, key=lambda e: e["t"])
        last = {pid: (step, round(t - self.t0, 4)) for pid, (step, t) in self.last_step.items()}
        found = failures(events, last)
        if self.mode == "in-process":
            return in_process_recoveries(events, found)
        return restart_recoveries(events, found)

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
            lines.append("  no failure: no fault was injected and no worker was lost")
        return "\n".join(lines)


def _recovery_lines(r: Recovery, phases: list[tuple[str, str]]) -> list[str]:
    def at(key: str) -> str:
        return "   -   " if r[key] is None else f"{r[key]:7.2f}"

    lines = [
        f"  {at('fault_t')}  {'' if r['real'] else 'fault: '}{r['fault']} at step "
        f"{_step(r['fault_step'])}",
        f"  {at('detected_t')}  detected ({r['detected_by']})",
        *(f"  {at(key)}  {what}" for key, what in phases),
    ]
    if "recovery_s" in r:
        lines.append(
            f"           recovery {r['recovery_s']:.2f} s from fault to first step; "
            f"{r['steps_redone']} step(s) redone"
        )
    return lines


def _step(step: int | None) -> str:
    return "?" if step is None else str(step)


def failures(events: list[Event], last_step: dict[int, tuple[int, float]]) -> list[Event]:
    """The failures among ``events`` (sorted by time): each injected ``fault``, and each
    detection (`DETECTIONS`) that no earlier failure explains. A failure explains what
    is detected until some rank completes its first step after it (a kill makes torchrun
    stop the other ranks: their exits are the same failure), except the loss of a
    process that started after it (a failure during recovery). Exits after which nothing
    restarted, in a launch that ended with exit code 0, are workers that finished. A
    real failure is dated to
    the failed process's last sign of life (its last event or step, ``last_step``: pid ->
    (step, t)), at the step it last completed."""
    out: list[Event] = []
    open_: float | None = None  # when the failure still being recovered from struck
    struck: int | None = None  # in which attempt (generation): its first steps are not after it
    ended_ok = any(e["event"] == "done" and e.get("exit_code") == 0 for e in events)
    started = {
        e["pid"]: e["t"] if e.get("process_start") is None else e["process_start"]
        for e in events
        if e["event"] == "process_start"
    }
    for i, e in enumerate(events):
        if e["event"] == "fault":
            out.append(e)
            open_, struck = e["t"], e.get("attempt")
        elif e["event"] == "first_step" and not _same_attempt(e, struck):
            open_ = None
        elif e["event"] in DETECTIONS and (open_ is None or started.get(e.get("pid"), 0) > open_):
            restarted = any(x["event"] in ("process_start", "respawn") for x in events[i:])
            if ended_ok and not restarted and e["event"] != "remote_failure":
                continue  # the workers finished: a launch that ends well had no failure
            out.append(_real_failure(e, events, last_step))
            open_, struck = out[-1]["t"], e.get("attempt")
    return out


def _same_attempt(first_step: Event, struck: int | None) -> bool:
    """Whether ``first_step`` is of the attempt a failure struck in (a rank's first step
    of the run, logged after a fault at step 1): not the first step after the failure."""
    attempt = first_step.get("attempt")
    return struck is not None and attempt is not None and attempt <= struck


def _real_failure(
    detected: Event, events: list[Event], last_step: dict[int, tuple[int, float]]
) -> Event:
    pid, rank = detected.get("pid"), detected.get("rank")
    launcher = (*DETECTIONS, "hung")  # the launcher's events about the process
    mine = [e for e in events if pid is not None and e.get("pid") == pid]  # not a node's
    seen = [e["t"] for e in mine if e["event"] not in launcher]
    step, step_t = last_step.get(pid, (None, None)) if pid is not None else (None, None)
    if step_t is not None:
        seen.append(step_t)
    silent = detected.get("silent_s", detected.get("idle_s"))  # since its last heartbeat
    if silent is not None:
        seen.append(detected["t"] - silent)
    t = max(seen, default=detected["t"])
    what = {"worker_exit": "exited", "hang_detected": "hung", "node_kill_requested": "lost"}
    who = f"rank {rank}" if rank is not None else f"node {detected.get('node')}"
    spec = detected.get("what") or f"{who} {what[detected['event']]}"  # remote: as seen
    return {
        "event": "fault",
        "t": min(t, detected["t"]),
        "spec": f"real failure: {spec}",
        "step": detected.get("step", step),
        "real": True,
    }


def _detection(fault: Event, after: list[Event]) -> Recovery:
    """What every recovery starts with: the fault, and the first sign of it."""
    detected = next((e for e in after if e["event"] in DETECTIONS), None)
    return {
        "fault": fault["spec"],
        "real": bool(fault.get("real")),
        "fault_t": fault["t"],
        "fault_step": fault["step"],
        "detected_t": None if detected is None else detected["t"],
        "detected_by": None if detected is None else detected["event"],
    }


def _finish(rec: Recovery, fault: Event) -> Recovery:
    if rec["first_step_t"] is not None:
        rec["recovery_s"] = round(rec["first_step_t"] - fault["t"], 4)
        known = fault["step"] is not None and rec["first_step"] is not None
        # The fault's step is the last one ticked: one applied but not yet ticked when the
        # fault came (its record rebuilt, `unbroken.healing.inflight`) is not redone.
        rec["steps_redone"] = max(0, fault["step"] - rec["first_step"] + 1) if known else "?"
    return rec


# -- restart-all (torchrun) -------------------------------------------------------------


def restart_recoveries(events: list[Event], faults: list[Event]) -> list[Recovery]:
    """Per failure: when it happened, was detected, workers restarted, the process
    group was ready again, and every rank had completed a step again."""
    out = []
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


def in_process_recoveries(events: list[Event], faults: list[Event]) -> list[Recovery]:
    """Per failure: detection, the new generation and respawn, the process group
    ready on every rank, the restore done on every rank, the first step."""
    out = []
    for fault in faults:
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
