"""``unbroken run`` without ``--in-process``: torchrun agents, which restart every worker
when one fails, under the shared watchdog (`unbroken.run.watch`).

Every torchrun option passes through unchanged: the agents are torchrun itself
(``python -m torch.distributed.run``), so a job runs the same way on one machine, across
machines, and under Kubernetes (docs/kubernetes.md). On top of torchrun:

* ``--heartbeat-timeout S``: workers report each step (`unbroken.run.tick`); a worker
  that stops reporting for S seconds is SIGKILLed, so torchrun restarts the workers now
  instead of after the collective timeout (30 minutes for gloo by default).
* ``--inject-fault SPEC``: kill a rank, hang a rank, or kill a whole simulated node at a
  given step (see `unbroken.run.faults`).
* ``--simulate-nodes N``: N torchrun agents on this machine joined by c10d rendezvous,
  each a "node" with its own shared-memory directory; killing one deletes its memory and
  starts a replacement agent, like a new machine joining.
* a timeline (fault, detection, restart, first step after it) printed at the end and
  written as JSON with ``--timeline-json`` (`unbroken.run.timeline`).

torchrun's c10d rendezvous store listens on every interface, and its state is a pickle
that every agent loads: whoever reaches it could run code as the job's user. So the
launcher hosts that store itself, on the one address the job needs (`bind_rendezvous`):
on loopback for one node (simulated nodes included), on the address ``--rdzv-endpoint``
names for the node that hosts it across machines. docs/kubernetes.md says what torchrun
still exposes there, and how to fence it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from unbroken.run import contract, listen
from unbroken.run.args import RunOptions, torchrun_parser
from unbroken.run.nodes import NodeMemory
from unbroken.run.pace import Pace
from unbroken.run.procs import kill_tree
from unbroken.run.timeline import Timeline, say
from unbroken.run.watch import Stale, Watch

AFTER_KILL = "torchrun restarts the workers"  # what follows a watchdog kill
# A lost node's agent leaves the c10d rendezvous once it misses this many keep-alives at
# this interval (seconds): 2 x 1 s instead of torch's default 3 x 5 s, which left the
# surviving agents waiting ~13 s for the dead one before they could re-rendezvous.
KEEP_ALIVE = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2"}
RDZV_PORT = 29400  # torch's c10d rendezvous port where --rdzv-endpoint names none
_TRUE = ("1", "true", "t", "yes", "y")  # torch's spellings of a true --rdzv-conf value
# What a one-node job's own rendezvous replaces (`bind_rendezvous`).
ONE_NODE_SETS = {
    "--standalone",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--master-addr",
    "--master-port",
}


def with_keep_alive(opts: list[str]) -> list[str]:
    """torchrun options with `KEEP_ALIVE` merged into ``--rdzv-conf`` (the user's own
    values win), for a job across machines (``--nnodes`` other than 1)."""
    out, conf, i = [], "", 0
    nnodes = "1"
    while i < len(opts):
        name, eq, value = opts[i].partition("=")
        takes = not eq and i + 1 < len(opts)
        if name.replace("_", "-") in ("--rdzv-conf", "--nnodes"):
            value = value if eq else (opts[i + 1] if takes else "")
            i += 1 if eq else 2
            if name.replace("_", "-") == "--nnodes":
                nnodes = value
                out.append(f"--nnodes={value}")
            else:
                conf = value
            continue
        out.append(opts[i])
        i += 1
    if nnodes.split(":")[-1] in ("1", ""):
        return opts
    given = dict(kv.split("=", 1) for kv in conf.split(",") if "=" in kv)
    merged = {**KEEP_ALIVE, **given}
    return [*out, "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in merged.items())]


def _drop(opts: list[str], names: set[str]) -> tuple[list[str], dict[str, str]]:
    """``opts`` without the options ``names`` (spelt with - or _), and their values
    ("" for the flag ``--standalone``)."""
    out: list[str] = []
    found: dict[str, str] = {}
    i = 0
    while i < len(opts):
        name, eq, value = opts[i].partition("=")
        key = name.replace("_", "-")
        if key not in names:
            out.append(opts[i])
        elif eq or key == "--standalone" or i + 1 == len(opts):
            found[key] = value
        else:
            found[key] = opts[i + 1]
            i += 1
        i += 1
    return out, found


def _conf(text: str, **forced: str) -> str:
    """``--rdzv-conf`` text ``text`` with the values ``forced`` (they win)."""
    given = dict(kv.split("=", 1) for kv in text.split(",") if "=" in kv)
    return ",".join(f"{k}={v}" for k, v in {**given, **forced}.items())


def bind_rendezvous(opts: list[str], targs: argparse.Namespace) -> tuple[list[str], Any]:
    """torchrun options ``opts`` (parsed: ``targs``) under which the launcher hosts the
    rendezvous store, on the one address the job needs, and that store; None where
    torchrun keeps its own (another backend, a node that does not host it, an endpoint
    naming no address here). One node: loopback. Across machines, on the node that
    hosts it (``is_host`` in ``--rdzv-conf``, else torch's own test of the endpoint's
    name): the address the endpoint's name has here (`listen.local_address`)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    backend, endpoint = targs.rdzv_backend, targs.rdzv_endpoint or ""
    host, port = parse_rendezvous_endpoint(endpoint, RDZV_PORT)
    if not endpoint and backend == "static":
        host, port = targs.master_addr, targs.master_port or 0
    nodes = str(targs.nnodes).split(":")[-1]
    if targs.standalone or (
        nodes == "1" and backend in ("static", "c10d") and listen.is_loopback(host)
    ):
        store = listen.store(listen.LOOPBACK, 0 if targs.standalone else port, timeout=300)
        # torchrun names a one-node job anew where it made the rendezvous up itself.
        fresh = targs.standalone or (backend == "static" and targs.master_port is None)
        rest, given = _drop(opts, ONE_NODE_SETS)
        return [
            *rest,
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={listen.LOOPBACK}:{store.port}",
            f"--rdzv-id={uuid.uuid4() if fresh else targs.rdzv_id}",
            f"--rdzv-conf={_conf(given.get('--rdzv-conf', ''), is_host='false')}",
            # The node's address, where worker rank 0's store is (MASTER_ADDR): loopback.
            *([] if targs.local_addr else [f"--local-addr={listen.LOOPBACK}"]),
        ], store
    if backend != "c10d" or not endpoint:
        return opts, None
    return _host_across(opts, host, port)


def _host_across(opts: list[str], host: str, port: int) -> tuple[list[str], Any]:
    """`bind_rendezvous` across machines."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    rest, given = _drop(opts, {"--rdzv-conf"})  # keep-alives merged in: `with_keep_alive`
    conf = given.get("--rdzv-conf", "")
    told = dict(kv.split("=", 1) for kv in conf.split(",") if "=" in kv).get("is_host")
    if not (_matches_machine_hostname(host) if told is None else told.lower() in _TRUE):
        return opts, None
    addr = listen.local_address(host)
    if addr is None:
        say(
            f"torchrun's rendezvous store listens on every interface: {host} names no "
            "address of this machine but loopback; fence its port (docs/kubernetes.md)"
        )
        return opts, None
    try:
        store = listen.store(addr, port, timeout=300)
    except OSError as e:
        if told is not None:
            raise SystemExit(f"unbroken run: {e}") from None
        return opts, None  # another process here hosts it: torch's agent finds it too
    return [*rest, f"--rdzv-conf={_conf(conf, is_host='false')}"], store


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


class RestartAll:
    """A launch of torchrun agents (one, or one per simulated node): the job that
    `unbroken.run.cli.drive` runs, and the hooks of its `Watch`."""

    def __init__(self, opts: RunOptions, heartbeat_dir: str) -> None:
        self.opts = opts
        self.dir = heartbeat_dir
        self.timeline = Timeline(mode="restart")
        self.timeout = opts.ours.heartbeat_timeout
        self.watch = Watch(heartbeat_dir, self.timeline, Pace.of(opts.ours), self)
        self.agents: list[Agent] = []
        self.memory: NodeMemory | None = None
        self.store: Any = None  # torchrun's rendezvous store, if hosted here
        self.stopping = False

    def env(self) -> dict[str, str]:
        return contract.worker_env(self.dir, ";".join(str(f) for f in self.opts.faults))

    def start(self) -> None:
        nodes = self.opts.ours.simulate_nodes
        torchrun = self.opts.torchrun_opts
        if nodes is None:
            targs = torchrun_parser().parse_args([*torchrun, *self.opts.script])
            torchrun, self.store = bind_rendezvous(with_keep_alive(torchrun), targs)
        base = [sys.executable, "-m", "torch.distributed.run", *torchrun]
        if nodes is None:
            self.agents = [Agent(None, [*base, *self.opts.script], self.env())]
        else:
            self.agents = self._node_agents(base, nodes)
        what = "1 torchrun agent" if nodes is None else f"{nodes} simulated nodes"
        faults = "; ".join(map(str, self.opts.faults)) or "none"
        where = "" if self.store is None else f", rendezvous store {self._where()}"
        self.timeline.add(
            "launch", f"{what}{where}, heartbeat timeout {self.timeout:g} s, faults: {faults}"
        )
        for agent in self.agents:
            agent.start()

    def _where(self) -> str:
        host = self.store.host
        return f"[{host}]:{self.store.port}" if ":" in host else f"{host}:{self.store.port}"

    def _node_agents(self, base: list[str], nodes: int) -> list[Agent]:
        # The launcher hosts the rendezvous store: it must outlive any node.
        self.store = listen.store(timeout=300)
        job = f"unbroken-sim-{uuid.uuid4().hex[:8]}"
        self.memory = NodeMemory(job)
        agents = []
        for i in range(nodes):
            opts = [
                f"--nnodes={nodes}",
                f"--node-rank={i}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.store.port}",
                f"--rdzv-id={job}",
                "--rdzv-conf=is_host=false," + ",".join(f"{k}={v}" for k, v in KEEP_ALIVE.items()),
                # c10d rendezvous orders nodes by address: one loopback address per
                # node keeps node i at group rank i, replacement included.
                f"--local-addr=127.0.{100 + i}.1",
            ]
            env = self.env()
            env[contract.NODE_ENV] = str(i)
            env[contract.MEMORY_DIR_ENV] = self.memory.create(i)
            agents.append(Agent(i, [*base, *opts, *self.opts.script], env))
        return agents

    # -- the drive loop's calls

    def poll(self) -> bool:
        """After the watch's look: False once no agent runs. An agent that gave up (out
        of restarts) stops the others, which would wait in rendezvous."""
        live = [a for a in self.agents if a.returncode is None]
        failed = [a for a in self.agents if a.returncode not in (None, 0) and not a.killed]
        if not live:
            return False
        if failed and not self.stopping:
            node = failed[0].node
            who = "the agent" if node is None else f"node {node}'s agent"
            self.timeline.add("agent_failed", f"{who} failed ({failed[0].returncode})")
            self.stop(signal.SIGTERM)
        return True

    def live_pids(self) -> list[int]:
        return [a.proc.pid for a in self.agents if a.proc is not None and a.returncode is None]

    def exit_code(self) -> int:
        codes = [a.returncode for a in self.agents if not a.killed]
        return next((c for c in codes if c), 0) or 0

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
        if self.memory is not None:
            self.memory.remove()

    # -- the watch's hooks

    def since(self, beat: float, attempt: int) -> float:
        return beat

    def on_hang(self, stale: list[Stale], now: float) -> None:
        # The rank furthest behind is the hung one; the others wait for it in a
        # collective. Killing one worker is enough: torchrun restarts them all.
        step, t, rank, pid = min(stale)
        self.timeline.add(
            "hang_detected",
            f"rank {rank} (pid {pid}) made no progress for {now - t:.1f} s "
            f"(last step {step}): SIGKILL, {AFTER_KILL}",
            rank=rank,
            pid=pid,
            step=step,
            idle_s=round(now - t, 3),
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.watch.ignore(pid)
        self.watch.hold_off()

    def kill_node(self, node: int) -> None:
        assert self.memory is not None
        agent = next(a for a in self.agents if a.node == node and not a.killed)
        self.timeline.add("node_kill_requested", f"killing node {node}", node=node)
        assert agent.proc is not None
        pids = kill_tree(agent.proc.pid)
        agent.proc.wait()
        agent.killed = True
        lost = self.memory.lose(node)
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
