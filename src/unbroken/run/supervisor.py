"""``unbroken run --in-process``: the supervisor that replaces only the failed ranks.

With torchrun, any worker's death makes the elastic agent restart every worker. Here the
launcher spawns the workers itself, one process per rank (``--nproc-per-node L`` on each
of ``--simulate-nodes N`` simulated nodes, or one node), and hosts a TCPStore that
outlives them all, holding a generation counter. When a worker dies (it crashed, the
heartbeat watchdog killed it as hung, or a kill-node fault took its whole node and its
shared memory), the supervisor bumps the generation and respawns only the dead ranks, with
the same rank numbers. Before that it sets ``unbroken/abort-<g>`` in the store: the
healthy ranks abort the generation's process groups, so their collectives fail at once
even where gloo would wait for its timeout; `unbroken.run.in_process` catches that, joins
the new generation's process group and runs ``train()`` again in the same process,
restoring from its own shared memory, while the replacements pull theirs from peer
replicas. Spares used, and the memory of a killed node, are replaced and freed once every
rank has completed a step again: both take CPU the recovery needs.

``--warm-spare`` keeps one standby process per node, forked with the ranks from one
template that imported torch once (`unbroken.run.spare`). A spare is a standby machine,
not part of any node: a node that is killed does not take the spares with it.

The heartbeat watchdog, event reading and kill-node requests are the shared `Watch`;
this module supplies its hooks. Scope: one machine (simulated nodes included); the
training script must call `unbroken.run.in_process`. Across machines, one node agent per
node (`unbroken.run.agent`, a subclass) does this for its own ranks, and an ``unbroken
coordinator`` (`unbroken.run.coordinator`) hosts the store and decides the generations.
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
import time
import uuid
from dataclasses import dataclass
from typing import Any

from unbroken.run import contract, listen
from unbroken.run.args import RunOptions
from unbroken.run.nodes import NodeMemory
from unbroken.run.pace import Pace
from unbroken.run.procs import Process, kill_tree
from unbroken.run.spare import Spares
from unbroken.run.timeline import Timeline, say
from unbroken.run.watch import Stale, Watch

AFTER_KILL = "the supervisor replaces that rank only"  # what follows a watchdog kill
PROBE_S = 1.0  # how long ranks have to answer an abort after a hang (ms if alive)


@dataclass
class RankProcess:
    """The process running ``rank`` in ``generation``."""

    rank: int
    node: int
    generation: int
    proc: Process | None = None
    done: bool = False  # exited 0: finished training


class Supervisor:
    """An in-process launch: one process per rank, replaced alone when it fails; the
    job that `unbroken.run.cli.drive` runs, and the hooks of its `Watch`."""

    def __init__(self, opts: RunOptions, targs: argparse.Namespace, heartbeat_dir: str) -> None:
        self.opts, self.targs = opts, targs
        self.dir = heartbeat_dir
        self.timeline = Timeline(mode="in-process")
        self.timeout = opts.ours.heartbeat_timeout
        self.watch = Watch(heartbeat_dir, self.timeline, Pace.of(opts.ours), self)
        self.stopping = False
        self.store: Any = None  # generation counter, abort keys, spares; outlives workers
        self.spares: Spares | None = None
        self.memory: NodeMemory | None = None
        self.nodes = opts.ours.simulate_nodes or 1
        assert opts.nproc_per_node is not None
        self.local = opts.nproc_per_node
        self.world = self.nodes * self.local
        self.generation = 0
        self.generation_t = 0.0  # when it started (wall clock, as heartbeats)
        self.recoveries = 0
        self.workers: dict[int, RankProcess] = {}
        self.run_id = targs.rdzv_id if targs.rdzv_id != "none" else f"unbroken-{uuid.uuid4()}"
        self.failure: str | None = None
        self.lost: list[str] = []  # shared memory of killed nodes, to delete
        self.probing: tuple[int, float] | None = None  # after a hang: generation, deadline

    # -- processes

    def base_env(self) -> dict[str, str]:
        env = contract.worker_env(self.dir, ";".join(str(f) for f in self.opts.faults))
        env.update(
            {
                contract.IN_PROCESS_ENV: "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.store.port),
                "WORLD_SIZE": str(self.world),
                "LOCAL_WORLD_SIZE": str(self.local),
                "TORCHELASTIC_RUN_ID": self.run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_MAX_RESTARTS": str(self.opts.max_restarts),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            }
        )
        return env

    def rank_env(self, rank: int, generation: int) -> dict[str, str]:
        node = rank // self.local
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % self.local),
            "GROUP_RANK": str(node),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.world),
            "TORCHELASTIC_RESTART_COUNT": str(generation),
        }
        if self.memory is not None:
            env[contract.NODE_ENV] = str(node)
            env[contract.MEMORY_DIR_ENV] = self.memory.path(node)
        return env

    def script_argv(self) -> tuple[list[str], bool]:
        """The worker's command after the interpreter, and whether it is a module."""
        script = list(self.opts.script)
        if self.targs.no_python:
            return script, False
        return script, bool(self.targs.module)

    def command(self) -> list[str]:
        script, module = self.script_argv()
        if self.targs.no_python:
            return script
        return [sys.executable, "-u", *(["-m"] if module else []), *script]

    def spawn(self, rank: int, generation: int) -> None:
        worker = RankProcess(rank, rank // self.local, generation)
        env = self.rank_env(rank, generation)
        spare = None if self.spares is None else self.spares.take()
        if spare is not None:
            assert self.spares is not None
            worker.proc = spare.proc
            # Before the assignment: its own beat as it takes it (`spare.serve`) comes later.
            self.watch.expect(rank, spare.proc.pid, generation, importing=not spare.ready)
            self.spares.assign(spare.key, env, *self.script_argv())
        else:
            worker.proc = subprocess.Popen(
                self.command(), env={**self.base_env(), **env}, start_new_session=True
            )
            self.watch.expect(rank, worker.proc.pid, generation, contract.FIRST_STEP_S)
        self.workers[rank] = worker
        self.timeline.add(
            "respawn" if generation else "spawn",
            f"rank {rank} (pid {worker.proc.pid}) started for generation {generation}"
            + (" from a warm spare" if spare is not None else ""),
            rank=rank,
            pid=worker.proc.pid,
            generation=generation,
            spare=spare is not None,
        )

    def start(self) -> None:
        self.store = listen.store()  # loopback only: the job's processes are all here
        self.store.add(contract.GENERATION_KEY, 0)
        if self.opts.ours.simulate_nodes is not None:
            self.memory = NodeMemory(f"unbroken-sim-{uuid.uuid4().hex[:8]}")
            for node in range(self.nodes):
                self.memory.create(node)
        faults = "; ".join(map(str, self.opts.faults)) or "none"
        spares = f", {self.nodes} warm spare(s)" if self.opts.ours.warm_spare else ""
        self.timeline.add(
            "launch",
            f"in-process: {self.world} rank(s) on {self.nodes} node(s){spares}, heartbeat "
            f"timeout {self.timeout:g} s, faults: {faults}",
        )
        if self.opts.ours.warm_spare:  # first: the ranks are forked from its template
            self.spares = Spares(self.store, self.base_env, self.script_argv())
        for rank in range(self.world):
            self.spawn(rank, 0)
        if self.spares is not None:
            self.spares.start(self.nodes)

    # -- the drive loop's calls

    def poll(self) -> bool:
        """After the watch's look: replace failed ranks; False once no rank runs and
        either all finished or the launch is stopping."""
        if not self.stopping:
            self.check_workers()
            self.probe()
            self.replenish()
        live = self.live_pids()
        return bool(live) or not (self.stopping or all(w.done for w in self.workers.values()))

    def live_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers.values() if w.proc and w.proc.poll() is None]

    def exit_code(self) -> int:
        if self.failure is not None:
            say(self.failure)
        return 0 if self.failure is None and not self.stopping else 1

    # -- the watch's hooks

    def since(self, beat: float, attempt: int) -> float:
        """A healthy rank that has not ticked in the current generation yet waits for
        the replacements: its clock starts once every rank has started the generation,
        or, if one takes longer than a heartbeat timeout to start, after that."""
        if attempt >= self.generation:
            return beat
        started = self.reached("init_start", self.generation)
        if len(started) == self.world:
            return max(beat, self.timeline.t0 + max(started.values()))
        return max(beat, self.generation_t + self.timeout)

    def on_hang(self, stale: list[Stale], now: float) -> None:
        """A hang cannot be pinned on a rank from outside: every rank waiting for it in a
        collective stops making progress too, and heartbeats are sampled. So abort the
        generation first: ranks that answer (their collectives fail, they say so) are
        alive; `probe` replaces those that stay silent."""
        if self.probing is not None:
            return
        ranks = sorted(s.rank for s in stale)
        idle = max(now - s.beat for s in stale)
        self.timeline.add(
            "hang_detected",
            f"ranks {ranks} made no progress for {idle:.1f} s: aborting generation "
            f"{self.generation} to find the hung one(s)",
            ranks=ranks,
            idle_s=round(idle, 3),
        )
        self.abort([])
        self.probing = (self.generation, time.monotonic() + PROBE_S)
        self.watch.hold_off()

    def kill_node(self, node: int) -> None:
        assert self.memory is not None
        self.timeline.add("node_kill_requested", f"killing node {node}", node=node)
        doomed = [w for w in self.workers.values() if w.node == node and w.proc is not None]
        for w in doomed:
            assert w.proc is not None
            kill_tree(w.proc.pid)
        self.abort(sorted(w.rank for w in doomed))  # the healthy ranks go ahead meanwhile
        for w in doomed:
            assert w.proc is not None
            w.proc.wait()
        self.lost.append(self.memory.lose(node))
        self.timeline.add(
            "node_killed",
            f"node {node} killed ({len(doomed)} processes) and its shared memory deleted",
            node=node,
        )
        # check_workers() now finds them dead and replaces them, as a new node joining.

    # -- recovery

    def reached(self, event: str, generation: int) -> dict[int, float]:
        """The ranks that reported ``event`` in ``generation``, and when (last time,
        seconds since launch)."""
        found: dict[int, float] = {}
        for e in self.timeline.events:
            if e["event"] == event and e.get("attempt") == generation:
                found[e["rank"]] = max(e["t"], found.get(e["rank"], e["t"]))
        return found

    def probe(self) -> None:
        """After `on_hang`: kill the ranks that did not answer the abort in time, which
        `check_workers` then replaces; if every rank answered (a collective that could
        never complete), start a new generation with all of them."""
        if self.probing is None:
            return
        generation, deadline = self.probing
        answered = self.answered(generation)
        live = {w.rank: w for w in self.workers.values() if w.proc and w.proc.poll() is None}
        silent = sorted(set(live) - answered)
        if silent and time.monotonic() < deadline:
            return
        self.probing = None
        self.watch.hold_off()
        for rank in silent:
            proc = live[rank].proc
            assert proc is not None
            self.kill_hung(rank, proc, AFTER_KILL)
        if not silent:
            self.recover([])

    def answered(self, generation: int) -> set[int]:
        """The ranks that answered an abort of ``generation``: each said it lost a peer,
        or, still joining, that its join failed (a peer never joined)."""
        failed = self.reached("peer_failure", generation)
        return {*failed, *self.reached("init_failed", generation)}

    def kill_hung(self, rank: int, proc: Process, after: str) -> None:
        """SIGKILL ``rank``'s process, which did not answer an abort, and say so."""
        self.timeline.add(
            "hung",
            f"rank {rank} (pid {proc.pid}) did not answer the abort: SIGKILL, {after}",
            rank=rank,
            pid=proc.pid,
        )
        kill_tree(proc.pid)
        self.watch.ignore(proc.pid)

    def replenish(self) -> None:
        """Once every rank completed a step in the new generation, replace the spares
        the recovery used and free the lost node's memory: a spare importing torch, or
        the kernel freeing pages, takes CPU the recovery needs."""
        if not (self.spares is not None and self.spares.owed > 0) and not self.lost:
            return
        if len(self.reached("first_step", self.generation)) == self.world:
            if self.spares is not None:
                self.spares.replenish()
            for path in self.lost:
                shutil.rmtree(path, ignore_errors=True)
            self.lost = []

    def check_workers(self) -> None:
        dead = []
        for w in self.workers.values():
            assert w.proc is not None
            code = w.proc.poll()
            if code is None or w.done:
                continue
            if code == 0:
                w.done = True
                continue
            dead.append(w)
            if self.watch.saw_exit(w.proc.pid):
                self.timeline.add(
                    "worker_exit",
                    f"rank {w.rank} (pid {w.proc.pid}) exited with {code}",
                    rank=w.rank,
                    pid=w.proc.pid,
                    code=code,
                )
            else:  # its heartbeats said it exited first; the code says how
                self.timeline.add("exit_code", rank=w.rank, code=code)
        if dead:
            self.recover(sorted(w.rank for w in dead))

    def recover(self, ranks: list[int]) -> None:
        finished = sorted(
            {w.rank for w in self.workers.values() if w.done} | set(self.watch.finished.values())
        )
        if finished:
            self.give_up(
                f"ranks {ranks} failed after ranks {finished} finished: they cannot be "
                "replaced in-process (their peers are gone); run again without --in-process"
            )
            return
        if self.recoveries >= self.opts.max_restarts:
            self.give_up(
                f"ranks {ranks} failed and the {self.opts.max_restarts} recoveries that "
                "--max-restarts allows are used up"
            )
            return
        self.recoveries += 1
        self.abort(ranks)
        self.generation = int(self.store.add(contract.GENERATION_KEY, 1))
        self.store.set(f"{contract.STARTED_KEY}-{self.generation}", "")  # survivors wait on it
        self.generation_t = time.time()
        self.timeline.add(
            "generation",
            f"generation {self.generation}: replacing ranks {ranks}; the others stay",
            generation=self.generation,
            ranks=ranks,
        )
        for rank in ranks:
            self.spawn(rank, self.generation)

    def abort(self, ranks: list[int]) -> None:
        """Tell the healthy ranks that the generation failed, first thing: their
        collectives may be stuck on the dead ranks (see `unbroken.job.abort`)."""
        self.store.set(f"{contract.ABORT_KEY}-{self.generation}", json.dumps({"failed": ranks}))

    def give_up(self, why: str) -> None:
        self.failure = why
        self.timeline.add("give_up", why)
        self.stop(signal.SIGTERM)

    def stop(self, sig: int) -> None:
        self.stopping = True
        for w in self.workers.values():
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, sig)

    def cleanup(self) -> None:
        spares = [] if self.spares is None else self.spares.processes()
        for proc in [w.proc for w in self.workers.values()] + spares:
            if proc is not None and proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
        if self.memory is not None:
            self.memory.remove()
