"""``unbroken run``: torchrun, plus a hang watchdog, fault injection, simulated nodes and a
recovery timeline.

    unbroken run [unbroken options] [torchrun options] train.py [args]

Every torchrun option passes through unchanged: the agents are torchrun itself
(``python -m torch.distributed.run``), so a job runs the same way on one machine, across
machines, and under Kubernetes (docs/kubernetes.md). On top of torchrun:

* ``--heartbeat-timeout S``: workers report each step (`unbroken.faults.tick`); a worker
  that stops reporting for S seconds is SIGKILLed, so torchrun restarts the workers now
  instead of after the collective timeout (30 minutes for gloo by default).
* ``--inject-fault SPEC``: kill a rank, hang a rank, or kill a whole simulated node at a
  given step (see `unbroken.faults`).
* ``--simulate-nodes N``: N torchrun agents on this machine joined by c10d rendezvous,
  each a "node" with its own shared-memory directory; killing one deletes its memory and
  starts a replacement agent, like a new machine joining.
* a timeline (fault, detection, restart, first step after it) printed at the end and
  written as JSON with ``--timeline-json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from unbroken import faults as fault_specs
from unbroken.faults import FAULT_ENV, HEARTBEAT_DIR_ENV, NODE_ENV, Fault

MEMORY_DIR_ENV = "UNBROKEN_MEMORY_DIR"
SIM_MEMORY_ROOT = "/dev/shm/unbroken-sim"
POLL_S = 0.05
STOP_GRACE_S = 30.0  # after SIGTERM, how long agents get before SIGKILL
# Options of ours that torchrun must not also get (the simulated nodes set them).
SIMULATION_SETS = (
    "--nnodes",
    "--node-rank",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--standalone",
    "--master-addr",
    "--master-port",
    "--local-addr",
)


def _say(message: str) -> None:
    print(f"unbroken run: {message}", file=sys.stderr, flush=True)


# -- the command line -------------------------------------------------------------------


def _our_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unbroken run",
        usage="unbroken run [unbroken options] [torchrun options] train.py [args]",
        description="torchrun with a hang watchdog, fault injection, simulated nodes and a "
        "recovery timeline. Every other option goes to torchrun unchanged.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="'kill rank=R step=S', 'hang rank=R step=S' or 'kill-node node=N step=S'; "
        "repeatable or ';'-separated. Needs --max-restarts 1 or more.",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="SIGKILL a worker that has not called unbroken.faults.tick() for this long "
        "(after its first tick), so torchrun restarts the workers (default 60; 0: off)",
    )
    p.add_argument(
        "--simulate-nodes",
        type=int,
        metavar="N",
        help="run N torchrun agents on this machine, each a node with its own shared memory",
    )
    p.add_argument("--timeline-json", type=Path, metavar="PATH", help="write the timeline here")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="replace only failed ranks, keeping the healthy ones alive (the script calls "
        "unbroken.inprocess.run); one machine only, simulated nodes included: run "
        "multi-machine jobs without it (see unbroken.supervisor)",
    )
    p.add_argument(
        "--warm-spare",
        action="store_true",
        help="with --in-process: keep a standby worker per node with torch imported",
    )
    return p


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def split_argv(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Split into (unbroken options, torchrun options, [script, *its args]).

    Ours may come anywhere before the script; anything after the script is the
    script's. Which torchrun options take a value is read from torchrun's own parser."""
    ours_takes_value = {"--inject-fault", "--heartbeat-timeout", "--simulate-nodes"}
    ours_takes_value.add("--timeline-json")
    our_flags = {"--in-process", "--warm-spare"}
    theirs: dict[str, bool] = {}
    for action in _torchrun_parser()._actions:
        for opt in action.option_strings:
            theirs[opt] = action.nargs != 0
    ours: list[str] = []
    torchrun: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg == "--":
            return ours, torchrun, argv[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            return ours, torchrun, argv[i:]
        target = ours if name in ours_takes_value or name in our_flags else torchrun
        target.append(arg)
        takes_value = name in ours_takes_value or (name not in our_flags and theirs.get(name, True))
        if "=" not in arg and takes_value and i + 1 < len(argv) and name not in ("-h", "--help"):
            target.append(argv[i + 1])
            i += 1
        i += 1
    return ours, torchrun, []


@dataclass
class Plan:
    ours: argparse.Namespace
    torchrun_opts: list[str]
    script: list[str]
    faults: list[Fault]
    max_restarts: int
    nproc_per_node: int | None


def plan(argv: list[str]) -> Plan:
    """Parse and check the command line; raises SystemExit(2) with a message if wrong."""
    ours_argv, torchrun_opts, script = split_argv(argv)
    parser = _our_parser()
    if not script and not ours_argv and any(a in ("-h", "--help") for a in torchrun_opts):
        parser.print_help()
        print("\ntorchrun options:")
        _torchrun_parser().print_help()
        raise SystemExit(0)
    ours = parser.parse_args(ours_argv)
    if not script:
        parser.error("no training script given: unbroken run [options] train.py [args]")
    targs = _torchrun_parser().parse_args([*torchrun_opts, *script])
    try:
        faults = fault_specs.parse(";".join(ours.inject_fault))
    except ValueError as e:
        parser.error(str(e))
    nproc = int(targs.nproc_per_node) if str(targs.nproc_per_node).isdigit() else None
    if faults and targs.max_restarts < 1:
        parser.error(
            f"--inject-fault needs --max-restarts 1 or more (got {targs.max_restarts}): "
            "otherwise the first fault ends the job"
        )
    if ours.heartbeat_timeout < 0:
        parser.error("--heartbeat-timeout must be positive (or 0 to turn the watchdog off)")
    nodes = ours.simulate_nodes
    if nodes is not None:
        if nodes < 1:
            parser.error(f"--simulate-nodes {nodes}: simulate at least one node")
        given = [
            o
            for o in torchrun_opts
            if o.split("=", 1)[0].replace("_", "-") in SIMULATION_SETS
            and not (o.startswith("--nnodes") and targs.nnodes == str(nodes))
        ]
        if given:
            parser.error(
                f"--simulate-nodes sets {', '.join(sorted(set(given)))} itself; leave them out"
            )
        if targs.max_restarts < 1:
            parser.error("--simulate-nodes needs --max-restarts 1 or more to recover a node")
    for f in faults:
        if f.kind == "kill-node":
            if nodes is None:
                parser.error(f"{str(f)!r} needs --simulate-nodes (a node is an agent here)")
            elif f.target >= nodes:
                parser.error(f"{str(f)!r}: there are only nodes 0..{nodes - 1}")
        elif nproc is not None and f.target >= nproc * (nodes or _int(targs.nnodes) or 1):
            parser.error(f"{str(f)!r}: no such rank in this job")
    return Plan(ours, torchrun_opts, script, faults, targs.max_restarts, nproc)


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


# -- agents -----------------------------------------------------------------------------


@dataclass
class Agent:
    """One torchrun agent: the whole job, or one simulated node."""

    node: int | None
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False  # by us, as a fault: its exit code does not count

    def start(self) -> None:
        # A session of its own: terminal signals come to the launcher, which forwards them.
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True)

    @property
    def returncode(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every process below it, like a machine losing power.

    torchrun starts workers in sessions of their own, so the tree is collected first
    (from /proc) and every process and process group in it is killed."""
    pids = [pid, *_descendants(pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(p), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    return pids


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    """Running: exists and is not a zombie (a dead worker torchrun has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# -- the timeline -----------------------------------------------------------------------


@dataclass
class Timeline:
    t0: float = field(default_factory=time.time)
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, event: str, say: str | None = None, t: float | None = None, **kw: Any) -> None:
        when = time.time() if t is None else t
        self.events.append({"event": event, "t": round(when - self.t0, 4), **kw})
        if say is not None:
            _say(f"[{when - self.t0:7.2f} s] {say}")

    def recoveries(self) -> list[dict[str, Any]]:
        """Per injected fault: when it happened, was detected, workers restarted, the
        process group was ready again, and every rank had completed a step again."""
        out = []
        events = sorted(self.events, key=lambda e: e["t"])
        faults = [e for e in events if e["event"] == "fault"]
        for i, fault in enumerate(faults):
            t = fault["t"]
            until = faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")
            detected = next(
                (
                    e
                    for e in events
                    if e["t"] >= t
                    and e["event"] in ("worker_exit", "hang_detected", "node_kill_requested")
                ),
                None,
            )
            # Processes that started after the fault: the restarted (or replacement) ones.
            starts = {
                e["pid"]: e["t"] if e.get("process_start") is None else e["process_start"]
                for e in events
                if e["event"] == "process_start"
            }
            # Before the next fault, unless both struck before any restart.
            new = {pid for pid, start in starts.items() if t < start < until} or {
                pid for pid, start in starts.items() if start > t
            }
            ready = [e["t"] for e in events if e["event"] == "init_done" and e["pid"] in new]
            firsts = [e for e in events if e["event"] == "first_step" and e["pid"] in new]
            rec: dict[str, Any] = {
                "fault": fault["spec"],
                "fault_t": t,
                "fault_step": fault["step"],
                "detected_t": None if detected is None else detected["t"],
                "detected_by": None if detected is None else detected["event"],
                "restart_t": min((starts[p] for p in new), default=None),
                "ready_t": max(ready) if ready else None,
                "first_step_t": max(e["t"] for e in firsts) if firsts else None,
                "first_step": min(e["step"] for e in firsts) if firsts else None,
            }
            if rec["first_step_t"] is not None:
                rec["recovery_s"] = round(rec["first_step_t"] - t, 4)
                rec["steps_redone"] = fault["step"] - rec["first_step"] + 1
            out.append(rec)
        return out

    def phases(self, r: dict[str, Any]) -> list[tuple[str, str]]:
        """The summary's lines between detection and recovery: (time key, what)."""
        return [
            ("restart_t", "workers restarted (process start)"),
            ("ready_t", "process group ready"),
            ("first_step_t", f"first step after restart: step {r['first_step']}"),
        ]

    def to_json(self, exit_code: int) -> dict[str, Any]:
        return {
            "t0": self.t0,
            "exit_code": exit_code,
            "events": sorted(self.events, key=lambda e: e["t"]),
            "recoveries": self.recoveries(),
        }

    TITLE = "timeline (seconds since launch):"

    def summary(self) -> str:
        lines = [self.TITLE]
        for r in self.recoveries():

            def at(key: str, r: dict[str, Any] = r) -> str:
                return "   -   " if r[key] is None else f"{r[key]:7.2f}"

            lines += [
                f"  {at('fault_t')}  fault: {r['fault']} at step {r['fault_step']}",
                f"  {at('detected_t')}  detected ({r['detected_by']})",
                *(f"  {at(key)}  {what}" for key, what in self.phases(r)),
            ]
            if "recovery_s" in r:
                lines.append(
                    f"           recovery {r['recovery_s']:.2f} s from fault to first step; "
                    f"{r['steps_redone']} step(s) redone"
                )
        if len(lines) == 1:
            lines.append("  no fault was injected")
        return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------


class Launch:
    def __init__(self, p: Plan, heartbeat_dir: str) -> None:
        self.plan = p
        self.dir = heartbeat_dir
        self.timeline = Timeline()
        self.timeout = p.ours.heartbeat_timeout
        self.agents: list[Agent] = []
        self.memory_root: str | None = None
        self.store: Any = None  # the simulated nodes' rendezvous store, hosted here
        self.beats: dict[int, tuple[int, float, int, int]] = {}  # rank: step, t, pid, attempt
        self.seen_exit: set[int] = set()
        self.killed_pids: set[int] = set()
        self.last_kill = float("-inf")
        self.offsets: dict[str, int] = {}
        self.stopping = False

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[HEARTBEAT_DIR_ENV] = self.dir
        env[FAULT_ENV] = ";".join(str(f) for f in self.plan.faults)
        # Worker rank 0 hosts a fresh store for each attempt instead of the agent sharing
        # one across attempts: no stale keys, no store dying with a killed agent, and no
        # reliance on restart counts, which differ on a replacement node.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        return env

    def start(self) -> None:
        base = [sys.executable, "-m", "torch.distributed.run", *self.plan.torchrun_opts]
        nodes = self.plan.ours.simulate_nodes
        if nodes is None:
            self.agents = [Agent(None, [*base, *self.plan.script], self.env())]
        else:
            import torch.distributed as dist

            # The launcher hosts the rendezvous store: it must outlive any node.
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            job = f"unbroken-sim-{uuid.uuid4().hex[:8]}"
            self.memory_root = os.path.join(SIM_MEMORY_ROOT, job)
            for i in range(nodes):
                opts = [
                    f"--nnodes={nodes}",
                    f"--node-rank={i}",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{self.store.port}",
                    f"--rdzv-id={job}",
                    # A killed node's agent leaves the rendezvous once it misses its
                    # keep-alives: 2 x 1 s instead of torch's default 3 x 5 s.
                    "--rdzv-conf=is_host=false,keep_alive_interval=1,keep_alive_max_attempt=2",
                    # c10d rendezvous orders nodes by address: one loopback address per
                    # node keeps node i at group rank i, replacement included.
                    f"--local-addr=127.0.{100 + i}.1",
                ]
                env = self.env()
                env[NODE_ENV] = str(i)
                env[MEMORY_DIR_ENV] = self.node_memory(i)
                os.makedirs(env[MEMORY_DIR_ENV], exist_ok=True)
                self.agents.append(Agent(i, [*base, *opts, *self.plan.script], env))
        what = "1 torchrun agent" if nodes is None else f"{nodes} simulated nodes"
        faults = "; ".join(map(str, self.plan.faults)) or "none"
        self.timeline.add(
            "launch", f"{what}, heartbeat timeout {self.timeout:g} s, faults: {faults}"
        )
        for agent in self.agents:
            agent.start()

    def node_memory(self, node: int) -> str:
        assert self.memory_root is not None
        return os.path.join(self.memory_root, f"node-{node}")

    def run(self) -> int:
        self.start()
        deadline = None
        while True:
            self.read_events()
            self.handle_node_requests()
            self.watch()
            live = [a for a in self.agents if a.returncode is None]
            failed = [a for a in self.agents if a.returncode not in (None, 0) and not a.killed]
            if not live:
                break
            if failed and not self.stopping:
                # One agent gave up (out of restarts): the others would wait in rendezvous.
                node = failed[0].node
                who = "the agent" if node is None else f"node {node}'s agent"
                self.timeline.add("agent_failed", f"{who} failed ({failed[0].returncode})")
                self.stop(signal.SIGTERM)
            if self.stopping:
                deadline = deadline or time.monotonic() + STOP_GRACE_S
                if time.monotonic() > deadline:
                    for a in live:
                        assert a.proc is not None
                        kill_tree(a.proc.pid)
            time.sleep(POLL_S)
        self.read_events()
        codes = [a.returncode for a in self.agents if not a.killed]
        code = next((c for c in codes if c), 0) or 0
        self.timeline.add("done", f"done, exit code {code}", exit_code=code)
        return code

    def stop(self, sig: int) -> None:
        self.stopping = True
        for agent in self.agents:
            if agent.returncode is None:
                assert agent.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent.proc.pid, sig)

    def cleanup(self) -> None:
        for agent in self.agents:
            if agent.proc is not None and agent.returncode is None:
                kill_tree(agent.proc.pid)
                agent.proc.wait()
        if self.memory_root is not None:
            shutil.rmtree(self.memory_root, ignore_errors=True)

    # -- events the workers write

    def read_events(self) -> None:
        for name in sorted(os.listdir(self.dir)):
            if not name.startswith("events-"):
                continue
            path = os.path.join(self.dir, name)
            with open(path, "rb") as f:
                f.seek(self.offsets.get(name, 0))
                data = f.read()
            whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            self.offsets[name] = self.offsets.get(name, 0) + len(whole)
            for line in whole.splitlines():
                e = json.loads(line)
                name_, t = e.pop("event"), e.pop("t")
                if e.get("process_start") is not None:  # like every time: since launch
                    e["process_start"] = round(e["process_start"] - self.timeline.t0, 4)
                say = None
                if name_ == "fault":
                    say = f"fault injected: {e['spec']} (rank {e['rank']} at step {e['step']})"
                self.timeline.add(name_, say, t=t, **e)

    # -- kill-node requests

    def handle_node_requests(self) -> None:
        for name in os.listdir(self.dir):
            if not name.startswith("request-kill-node-"):
                continue
            node = int(name.rsplit("-", 1)[1])
            os.unlink(os.path.join(self.dir, name))
            self.kill_node(node)

    def kill_node(self, node: int) -> None:
        agent = next(a for a in self.agents if a.node == node and not a.killed)
        self.timeline.add("node_kill_requested", f"killing node {node}", node=node)
        assert agent.proc is not None
        pids = kill_tree(agent.proc.pid)
        agent.proc.wait()
        agent.killed = True
        lost = self.lose_memory(node)
        threading.Thread(target=shutil.rmtree, args=(lost, True), daemon=True).start()
        self.timeline.add(
            "node_killed",
            f"node {node} killed ({len(pids)} processes) and its shared memory deleted",
            node=node,
        )
        replacement = Agent(node, agent.cmd, agent.env)
        replacement.start()
        self.agents.append(replacement)
        self.timeline.add("node_replaced", f"replacement agent for node {node} started", node=node)

    AFTER_KILL = "torchrun restarts the workers"  # what follows a watchdog kill

    def lose_memory(self, node: int) -> str:
        """Take ``node``'s shared memory away from it, as a lost machine's is: the
        directory is renamed at once (a replacement finds it empty); the caller deletes
        the returned path, which frees the pages and takes a while."""
        lost = f"{self.node_memory(node)}.lost-{uuid.uuid4().hex[:8]}"
        os.rename(self.node_memory(node), lost)
        os.makedirs(self.node_memory(node))
        return lost

    # -- heartbeats: worker exits and hangs

    def watch(self) -> None:
        now = time.time()
        for name in os.listdir(self.dir):
            if not name.startswith("rank-"):
                continue
            try:
                with open(os.path.join(self.dir, name)) as f:
                    step_s, t_s, pid_s, attempt_s = f.read().split()
                beat = (int(step_s), float(t_s), int(pid_s), int(attempt_s))
            except (OSError, ValueError):
                continue  # being written for the first time
            self.beats[int(name[5:])] = beat
        stale = []
        for rank, (step, t, pid, attempt) in sorted(self.beats.items()):
            if pid in self.seen_exit:
                continue
            if not _alive(pid):
                self.seen_exit.add(pid)
                self.timeline.add(
                    "worker_exit",
                    f"rank {rank} (pid {pid}, attempt {attempt}) exited; "
                    f"last heartbeat at step {step}",
                    rank=rank,
                    pid=pid,
                    step=step,
                )
            elif (
                self.timeout
                and now - self.since(t, attempt) > self.timeout
                and pid not in self.killed_pids
            ):
                stale.append((step, t, rank, pid))
        if stale and time.monotonic() - self.last_kill > self.timeout:
            self.on_hang(stale, now)

    def since(self, beat: float, attempt: int) -> float:
        """When a rank whose last heartbeat was at ``beat`` in ``attempt`` last showed
        it was making progress."""
        return beat

    def on_hang(self, stale: list[tuple[int, float, int, int]], now: float) -> None:
        """``stale``: (last step, last beat, rank, pid) of each rank past the timeout."""
        # The rank furthest behind is the hung one; the others wait for it in a
        # collective. Killing one worker is enough: torchrun restarts them all.
        step, t, rank, pid = min(stale)
        self.timeline.add(
            "hang_detected",
            f"rank {rank} (pid {pid}) made no progress for {now - t:.1f} s "
            f"(last step {step}): SIGKILL, {self.AFTER_KILL}",
            rank=rank,
            pid=pid,
            step=step,
            idle_s=round(now - t, 3),
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.killed_pids.add(pid)
        self.last_kill = time.monotonic()


def main(argv: list[str]) -> int:
    p = plan(argv)
    if p.ours.in_process or p.ours.warm_spare:
        from unbroken import supervisor

        return supervisor.main(p)
    return drive(p, lambda heartbeat_dir: Launch(p, heartbeat_dir), "the agents")


def drive(p: Plan, make: Callable[[str], Launch], what: str) -> int:
    """Run a launch (``make`` builds it on a fresh heartbeat directory), forwarding
    SIGINT/SIGTERM to ``what`` it started, then print and save its timeline."""
    with tempfile.TemporaryDirectory(prefix="unbroken-heartbeat-") as heartbeat_dir:
        launch = make(heartbeat_dir)

        def forward(sig: int, frame: FrameType | None) -> None:
            launch.timeline.add("signal", f"got signal {sig}: stopping {what}")
            launch.stop(sig)

        # Signal handlers can only be set from the main thread (not, say, from a test).
        main_thread = threading.current_thread() is threading.main_thread()
        sigs = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
        old = {s: signal.signal(s, forward) for s in sigs}
        try:
            code = launch.run()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            launch.cleanup()
    print(launch.timeline.summary(), file=sys.stderr, flush=True)
    if p.ours.timeline_json is not None:
        p.ours.timeline_json.write_text(json.dumps(launch.timeline.to_json(code), indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
