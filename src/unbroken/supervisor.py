"""``unbroken run --in-process``: the supervisor that replaces only the failed ranks.

With torchrun, any worker's death makes the elastic agent restart every worker. Here the
launcher spawns the workers itself, one process per rank (``--nproc-per-node L`` on each
of ``--simulate-nodes N`` simulated nodes, or one node), and hosts a TCPStore that
outlives them all, holding a generation counter. When a worker dies (it crashed, the
heartbeat watchdog killed it as hung, or a kill-node fault took its whole node and its
shared memory), the supervisor bumps the generation and respawns only the dead ranks, with
the same rank numbers. Before that it sets ``unbroken/abort-<g>`` in the store: the
healthy ranks abort the generation's process groups, so their collectives fail at once
even where gloo would wait for its timeout; `unbroken.inprocess.run` catches that, joins
the new generation's process group and runs ``train()`` again in the same process,
restoring from its own shared memory, while the replacements pull theirs from peer
replicas. Spares used, and the memory of a killed node, are replaced and freed once every
rank has completed a step again: both take CPU the recovery needs.

``--warm-spare`` keeps one standby process per node that has already imported torch and
waits on the store for a rank to take over, so a replacement skips the interpreter start
and the imports (about 2 s here). A spare is a standby machine, not part of any node: a
node that is killed does not take the spares with it.

Scope: one machine (simulated nodes included); the training script must call
`unbroken.inprocess.run`. Multi-machine jobs run without ``--in-process``, under torchrun.
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
from datetime import timedelta
from typing import Any

from unbroken.faults import NODE_ENV
from unbroken.inprocess import ABORT_KEY, GENERATION_KEY, IN_PROCESS_ENV
from unbroken.launcher import (
    MEMORY_DIR_ENV,
    POLL_S,
    SIM_MEMORY_ROOT,
    STOP_GRACE_S,
    Launch,
    Plan,
    Timeline,
    _say,
    _torchrun_parser,
    drive,
    kill_tree,
)

# torchrun options that make sense on one machine; anything else is multi-machine or
# elastic membership, which in-process mode does not do.
ALLOWED = {
    "--nproc-per-node",
    "--nproc_per_node",
    "--max-restarts",
    "--max_restarts",
    "--monitor-interval",
    "--monitor_interval",
    "--standalone",
    "--nnodes",
    "--run-id",
    "--run_id",
    "--rdzv-id",
    "--rdzv_id",
    "-m",
    "--module",
    "--no-python",
    "--no_python",
}


def check(p: Plan) -> argparse.Namespace:
    """Refuse what in-process mode cannot do; torchrun's parsed options."""
    parser = argparse.ArgumentParser(prog="unbroken run --in-process")
    targs = _torchrun_parser().parse_args([*p.torchrun_opts, *p.script])
    others = sorted({o.split("=", 1)[0] for o in p.torchrun_opts if o.startswith("-")} - ALLOWED)
    if others:
        parser.error(
            f"{', '.join(others)}: --in-process runs on one machine only (simulated nodes "
            "included); run multi-machine jobs without --in-process"
        )
    if targs.nnodes not in ("1", "1:1") and not (
        p.ours.simulate_nodes and targs.nnodes == str(p.ours.simulate_nodes)
    ):
        parser.error(f"--nnodes={targs.nnodes}: --in-process runs on one machine only")
    if p.nproc_per_node is None:
        parser.error("--in-process needs --nproc-per-node as a number")
    if p.ours.warm_spare and not p.ours.in_process:
        parser.error("--warm-spare needs --in-process")
    return targs


@dataclass
class Worker:
    rank: int
    node: int
    generation: int
    proc: subprocess.Popen[bytes] | None = None
    done: bool = False  # exited 0: finished training


class InProcessTimeline(Timeline):
    def recoveries(self) -> list[dict[str, Any]]:
        """Per injected fault: detection, the new generation and respawn, the process
        group ready on every rank, the restore done on every rank, the first step."""
        events = sorted(self.events, key=lambda e: e["t"])
        out = []
        for fault in (e for e in events if e["event"] == "fault"):
            t = fault["t"]
            after = [e for e in events if e["t"] >= t]
            detected = next(
                (
                    e
                    for e in after
                    if e["event"] in ("worker_exit", "hang_detected", "node_kill_requested")
                ),
                None,
            )
            bump = next((e for e in after if e["event"] == "generation"), None)
            rec: dict[str, Any] = {
                "fault": fault["spec"],
                "fault_t": t,
                "fault_step": fault["step"],
                "detected_t": None if detected is None else detected["t"],
                "detected_by": None if detected is None else detected["event"],
            }
            g = None if bump is None else bump["generation"]
            mine = [e for e in after if e.get("attempt") == g and "rank" in e]

            def last(name: str, of: list[dict[str, Any]] = mine) -> float | None:
                ts = [e["t"] for e in of if e["event"] == name]
                return max(ts) if ts else None

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
                ready_t=last("init_done"),
                restored_t=last("restore_done"),
                first_step_t=last("first_step"),
                first_step=min((e["step"] for e in firsts), default=None),
            )
            if rec["first_step_t"] is not None:
                rec["recovery_s"] = round(rec["first_step_t"] - t, 4)
                rec["steps_redone"] = fault["step"] - rec["first_step"] + 1
            out.append(rec)
        return out

    TITLE = "timeline (seconds since launch), in-process recovery:"

    def phases(self, r: dict[str, Any]) -> list[tuple[str, str]]:
        how = f"{r['warm_spares']} from warm spares" if r["warm_spares"] else "cold start"
        respawn = f"generation {r['generation']}: ranks {r['respawned']} respawned ({how})"
        return [
            ("noticed_t", "a healthy rank aborted its groups"),
            ("respawn_t", respawn),
            ("ready_t", "process group ready on every rank"),
            ("restored_t", "restore done on every rank"),
            ("first_step_t", f"first step after recovery: step {r['first_step']}"),
        ]


class Supervisor(Launch):
    """Reuses the launcher's heartbeat watchdog, event reading and kill-node requests;
    replaces its agents with one process per rank."""

    AFTER_KILL = "the supervisor replaces that rank only"
    PROBE_S = 1.0  # how long ranks have to answer an abort after a hang (ms if alive)

    def __init__(self, p: Plan, targs: argparse.Namespace, heartbeat_dir: str) -> None:
        super().__init__(p, heartbeat_dir)
        self.targs = targs
        self.timeline = InProcessTimeline()
        self.simulated = p.ours.simulate_nodes is not None
        self.nodes = p.ours.simulate_nodes or 1
        assert p.nproc_per_node is not None
        self.local = p.nproc_per_node
        self.world = self.nodes * self.local
        self.generation = 0
        self.generation_t = 0.0  # when it started (wall clock, as heartbeats)
        self.recoveries = 0
        self.workers: dict[int, Worker] = {}
        self.spares: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.run_id = targs.rdzv_id if targs.rdzv_id != "none" else f"unbroken-{uuid.uuid4()}"
        self.failure: str | None = None
        self.finished: dict[int, int] = {}  # pid -> rank: train() returned, exiting
        self.scanned = 0
        self.spares_owed = 0
        self.lost: list[str] = []  # shared memory of killed nodes, to delete
        self.probing: tuple[int, float] | None = None  # after a hang: generation, deadline

    # -- processes

    def base_env(self) -> dict[str, str]:
        env = self.env()
        env.update(
            {
                IN_PROCESS_ENV: "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.store.port),
                "WORLD_SIZE": str(self.world),
                "LOCAL_WORLD_SIZE": str(self.local),
                "TORCHELASTIC_RUN_ID": self.run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_MAX_RESTARTS": str(self.plan.max_restarts),
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
        if self.simulated:
            env[NODE_ENV] = str(node)
            env[MEMORY_DIR_ENV] = self.node_memory(node)
        return env

    def script_argv(self) -> tuple[list[str], bool]:
        """The worker's command after the interpreter, and whether it is a module."""
        script = list(self.plan.script)
        if self.targs.no_python:
            return script, False
        return script, bool(self.targs.module)

    def command(self) -> list[str]:
        script, module = self.script_argv()
        if self.targs.no_python:
            return script
        return [sys.executable, "-u", *(["-m"] if module else []), *script]

    def spawn(self, rank: int, generation: int) -> None:
        worker = Worker(rank, rank // self.local, generation)
        env = self.rank_env(rank, generation)
        spare = self.take_spare()
        if spare is not None:
            key, proc = spare
            script, module = self.script_argv()
            self.store.set(
                f"{key}/assign", json.dumps({"env": env, "argv": script, "module": module})
            )
            worker.proc = proc
            self.spares_owed += 1  # started once this recovery is done: see replenish
        else:
            worker.proc = subprocess.Popen(
                self.command(), env={**self.base_env(), **env}, start_new_session=True
            )
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

    def start_spare(self) -> None:
        key = f"unbroken/spare-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-u", "-m", "unbroken.inprocess", "--spare", key]
        proc = subprocess.Popen(cmd, env=self.base_env(), start_new_session=True)
        self.spares.append((key, proc))

    def take_spare(self) -> tuple[str, subprocess.Popen[bytes]] | None:
        for i, (key, proc) in enumerate(self.spares):
            if proc.poll() is None and self.store.check([f"{key}/ready"]):
                return self.spares.pop(i)
        return None

    def start(self) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.store.add(GENERATION_KEY, 0)
        if self.simulated:
            self.memory_root = os.path.join(SIM_MEMORY_ROOT, f"unbroken-sim-{uuid.uuid4().hex[:8]}")
            for node in range(self.nodes):
                os.makedirs(self.node_memory(node), exist_ok=True)
        faults = "; ".join(map(str, self.plan.faults)) or "none"
        spares = f", {self.nodes} warm spare(s)" if self.plan.ours.warm_spare else ""
        self.timeline.add(
            "launch",
            f"in-process: {self.world} rank(s) on {self.nodes} node(s){spares}, heartbeat "
            f"timeout {self.timeout:g} s, faults: {faults}",
        )
        for rank in range(self.world):
            self.spawn(rank, 0)
        if self.plan.ours.warm_spare:
            for _ in range(self.nodes):
                self.start_spare()

    # -- the loop

    def run(self) -> int:
        self.start()
        deadline = None
        while True:
            self.read_events()
            self.note_finished()
            self.handle_node_requests()
            self.watch()
            if not self.stopping:
                self.check_workers()
                self.probe()
                self.replenish()
            live = [w for w in self.workers.values() if w.proc and w.proc.poll() is None]
            if not live and (self.stopping or all(w.done for w in self.workers.values())):
                break
            if self.stopping:
                deadline = deadline or time.monotonic() + STOP_GRACE_S
                if time.monotonic() > deadline:
                    for w in live:
                        assert w.proc is not None
                        kill_tree(w.proc.pid)
            time.sleep(POLL_S)
        self.read_events()
        code = 0 if self.failure is None and not self.stopping else 1
        if self.failure is not None:
            _say(self.failure)
        self.timeline.add("done", f"done, exit code {code}", exit_code=code)
        return code

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

    def reached(self, event: str, generation: int) -> dict[int, float]:
        """The ranks that reported ``event`` in ``generation``, and when (last time,
        seconds since launch)."""
        found: dict[int, float] = {}
        for e in self.timeline.events:
            if e["event"] == event and e.get("attempt") == generation:
                found[e["rank"]] = max(e["t"], found.get(e["rank"], e["t"]))
        return found

    def on_hang(self, stale: list[tuple[int, float, int, int]], now: float) -> None:
        """A hang cannot be pinned on a rank from outside: every rank waiting for it in a
        collective stops making progress too, and heartbeats are sampled. So abort the
        generation first: ranks that answer (their collectives fail, they say so) are
        alive; `probe` replaces those that stay silent."""
        if self.probing is not None:
            return
        ranks = sorted(rank for _, _, rank, _ in stale)
        idle = max(now - t for _, t, _, _ in stale)
        self.timeline.add(
            "hang_detected",
            f"ranks {ranks} made no progress for {idle:.1f} s: aborting generation "
            f"{self.generation} to find the hung one(s)",
            ranks=ranks,
            idle_s=round(idle, 3),
        )
        self.abort([])
        self.probing = (self.generation, time.monotonic() + self.PROBE_S)
        self.last_kill = time.monotonic()

    def probe(self) -> None:
        """After `on_hang`: kill the ranks that did not answer the abort in time, which
        `check_workers` then replaces; if every rank answered (a collective that could
        never complete), start a new generation with all of them."""
        if self.probing is None:
            return
        generation, deadline = self.probing
        answered = self.reached("peer_failure", generation)
        live = {w.rank: w for w in self.workers.values() if w.proc and w.proc.poll() is None}
        silent = sorted(set(live) - set(answered))
        if silent and time.monotonic() < deadline:
            return
        self.probing = None
        self.last_kill = time.monotonic()
        for rank in silent:
            proc = live[rank].proc
            assert proc is not None
            self.timeline.add(
                "hung",
                f"rank {rank} (pid {proc.pid}) did not answer the abort: SIGKILL, "
                f"{self.AFTER_KILL}",
                rank=rank,
                pid=proc.pid,
            )
            kill_tree(proc.pid)
            self.killed_pids.add(proc.pid)
        if not silent:
            self.recover([])

    def replenish(self) -> None:
        """Once every rank completed a step in the new generation, replace the spares
        the recovery used and free the lost node's memory: a spare importing torch, or
        the kernel freeing pages, takes CPU the recovery needs."""
        if not self.spares_owed and not self.lost:
            return
        if len(self.reached("first_step", self.generation)) == self.world:
            for _ in range(self.spares_owed):
                self.start_spare()
            for path in self.lost:
                shutil.rmtree(path, ignore_errors=True)
            self.spares_owed, self.lost = 0, []

    def note_finished(self) -> None:
        """Ranks whose train() returned: they tick no more, so the watchdog leaves them
        alone, and a failure from now on cannot be recovered in-process."""
        for e in self.timeline.events[self.scanned :]:
            if e["event"] == "train_done":
                self.finished[e["pid"]] = e["rank"]
                self.killed_pids.add(e["pid"])
        self.scanned = len(self.timeline.events)

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
            if w.proc.pid not in self.seen_exit:
                self.seen_exit.add(w.proc.pid)
                self.timeline.add(
                    "worker_exit",
                    f"rank {w.rank} (pid {w.proc.pid}) exited with {code}",
                    rank=w.rank,
                    pid=w.proc.pid,
                    code=code,
                )
        if dead:
            self.recover(sorted(w.rank for w in dead))

    def recover(self, ranks: list[int]) -> None:
        finished = sorted(
            {w.rank for w in self.workers.values() if w.done} | set(self.finished.values())
        )
        if finished:
            self.give_up(
                f"ranks {ranks} failed after ranks {finished} finished: they cannot be "
                "replaced in-process (their peers are gone); run again without --in-process"
            )
            return
        if self.recoveries >= self.plan.max_restarts:
            self.give_up(
                f"ranks {ranks} failed and the {self.plan.max_restarts} recoveries that "
                "--max-restarts allows are used up"
            )
            return
        self.recoveries += 1
        self.abort(ranks)
        self.generation = int(self.store.add(GENERATION_KEY, 1))
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
        collectives may be stuck on the dead ranks (see `unbroken.abort`)."""
        self.store.set(f"{ABORT_KEY}-{self.generation}", json.dumps({"failed": ranks}))

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

    def kill_node(self, node: int) -> None:
        self.timeline.add("node_kill_requested", f"killing node {node}", node=node)
        doomed = [w for w in self.workers.values() if w.node == node and w.proc is not None]
        for w in doomed:
            assert w.proc is not None
            kill_tree(w.proc.pid)
        self.abort(sorted(w.rank for w in doomed))  # the healthy ranks go ahead meanwhile
        for w in doomed:
            assert w.proc is not None
            w.proc.wait()
        self.lost.append(self.lose_memory(node))
        self.timeline.add(
            "node_killed",
            f"node {node} killed ({len(doomed)} processes) and its shared memory deleted",
            node=node,
        )
        # check_workers() now finds them dead and replaces them, as a new node joining.

    def cleanup(self) -> None:
        procs = [w.proc for w in self.workers.values()] + [p for _, p in self.spares]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
        if self.memory_root is not None:
            shutil.rmtree(self.memory_root, ignore_errors=True)


def main(p: Plan) -> int:
    """`unbroken run --in-process ...`, after the launcher parsed the command line."""
    targs = check(p)
    return drive(p, lambda heartbeat_dir: Supervisor(p, targs, heartbeat_dir), "the workers")
