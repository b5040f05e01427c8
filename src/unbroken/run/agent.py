"""The node agent of a multi-node ``unbroken run --in-process`` job: one per node, started
the way torchrun is started on each node, all pointed at one ``unbroken coordinator``
(`unbroken.run.coordinator`), whose TCPStore every agent and worker uses.

    unbroken run --in-process --nnodes 2 --nproc-per-node 2 [--node-rank N] \\
        --rdzv-endpoint HOST:PORT --rdzv-id JOB train.py ...

The agent claims node slot N (``--node-rank``), or without it the first free slot, as a
replacement machine would: its ranks take the numbers of the node it replaces. It beats
a counter in the store (the coordinator's node-loss detector), and once more at once
whenever the coordinator pings (a worker somewhere reported a lost peer: the coordinator
tells the live nodes from the lost one by who answers), spawns its local ranks
when the coordinator says so, and watches them with the same `Watch` as the one-machine
supervisor (heartbeats, exit codes, kill-node faults). When a local rank fails it sets
``unbroken/abort-<g>`` at once (every healthy rank on every node aborts its groups), then
says which of its ranks it lost (``settled``); after a hang, it first gives its ranks
`PROBE_S` to answer the abort and kills the silent ones. When the coordinator starts the
next generation, the agent restarts only the ranks it is told to (warm spares if asked);
the healthy ranks go on in their processes (`unbroken.run.in_process`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
import uuid

from unbroken.run import contract, gate, listen, supervisor
from unbroken.run.args import RunOptions, endpoint
from unbroken.run.listen import LOOPBACK
from unbroken.run.news import Listener, announce, answer_pings, beat
from unbroken.run.procs import descendants, kill_tree
from unbroken.run.silence import BEAT_S, ping
from unbroken.run.spare import Spares
from unbroken.run.supervisor import Supervisor
from unbroken.run.timeline import first_line, say
from unbroken.run.watch import Stale

CLAIM_WAIT_S = 600.0  # how long an agent waits for its --node-rank's slot to be free
# From a ping or an abort on, for FAST_FOR_S, the agent checks its local ranks every
# FAST_POLL_S, not `run.cli.POLL_S` (a recovery's critical path); news wakes it anyway.
FAST_POLL_S, FAST_FOR_S = 0.01, 2.0
LOOK_S = 1.0  # between two looks at the store when nothing is announced (`run.news`)
# After a hang, how long ranks have to answer the abort before they are judged hung: more
# than on one machine, as the abort reaches them through the coordinator; once a rank of
# this node answered, it has reached the node: the others get the one machine's wait.
PROBE_S = 3.0


class NodeAgent(Supervisor):
    """One node of a multi-node in-process job: the `Supervisor`'s workers, spares and
    watch, restricted to this node's ranks, with the decisions left to the coordinator."""

    where = "?"  # the coordinator's address as given: messages name it, not the relay
    standby = False  # counted in the coordinator as waiting for a slot
    noted = -1  # the last generation whose failure elsewhere is on the timeline

    def __init__(self, opts: RunOptions, targs: argparse.Namespace, heartbeat_dir: str) -> None:
        super().__init__(opts, targs, heartbeat_dir)
        self.nodes = int(str(targs.nnodes).split(":")[-1])
        self.world = self.nodes * self.local
        self.host, self.port = endpoint(targs)
        self.where = f"{self.host}:{self.port}"
        self.relay: gate.Relay | None = None  # to the coordinator's gate, with a secret
        given = any(o.split("=")[0] in ("--node-rank", "--node_rank") for o in opts.torchrun_opts)
        self.wanted: int | None = int(targs.node_rank) if given else None
        self.slot = -1
        self.id = uuid.uuid4().hex[:12]
        self.generation = -1  # the last generation this agent started ranks for
        self.seen_abort = -1  # the last generation whose abort this agent handled
        self.dead: set[int] = set()  # local ranks lost in the running generation
        self.memory_dir = os.environ.get(contract.MEMORY_DIR_ENV) or contract.DEFAULT_MEMORY_ROOT
        self.stopped = threading.Event()  # ends the beat thread
        self.beater: threading.Thread | None = None
        self.answerer: threading.Thread | None = None
        self.fast_until = 0.0  # poll every FAST_POLL_S until then
        self.news: Listener | None = None
        self.looked = -math.inf

    # -- start: join the job, claim a slot

    def base_env(self) -> dict[str, str]:
        env = super().base_env()
        env["MASTER_ADDR"], env["MASTER_PORT"] = self.host, str(self.port)
        env[contract.COORDINATOR_ENV] = self.where
        return env

    def rank_env(self, rank: int, generation: int) -> dict[str, str]:
        env = super().rank_env(rank, generation)
        env[contract.NODE_ENV] = str(self.slot)
        env[contract.AGENT_ENV] = self.id  # a rank of a node declared lost stays out
        env[contract.MEMORY_DIR_ENV] = self.memory_dir
        env["GROUP_RANK"] = str(self.slot)
        return env

    def start(self) -> None:
        where = self.where
        try:  # etcd: its own TLS (`unbroken.run.etcd`); else the coordinator's gate
            secret, etcd = self.opts.ours.secret_file, listen.is_etcd(self.host)
            self.relay = None if etcd else gate.relay_to(self.host, self.port, secret)
        except (gate.GateError, OSError) as e:
            raise SystemExit(f"unbroken run: {e}") from None
        if self.relay is not None:  # every connection to the coordinator passes its gate
            self.host, self.port = LOOPBACK, self.relay.port
        try:
            self.store = listen.connect(self.host, self.port, 60.0)
        except Exception as e:
            if listen.is_etcd(self.host):  # etcd's error names its members, what to do
                raise SystemExit(f"unbroken run: {first_line(e)}") from None
            why = e if self.relay is None or self.relay.failure is None else self.relay.failure
            raise SystemExit(
                f"unbroken run: cannot reach the coordinator at {where} ({why}); start "
                f"`unbroken coordinator` there first, with this node's ${gate.SECRET_ENV}"
            ) from None
        try:
            self._join()
        except (RuntimeError, OSError) as e:  # torch's store errors: the coordinator left
            raise SystemExit(
                f"unbroken run: lost the coordinator at {where} while joining its job "
                f"({first_line(e)}); if the job is not over, restart `unbroken coordinator` "
                "there, then this agent"
            ) from None
        at = (self.host, self.port, self.id, self.stopped)
        self.beater = threading.Thread(target=beat, args=(*at, BEAT_S), name="unbroken-beat")
        self.beater.start()
        self.answerer = threading.Thread(
            target=answer_pings, args=(*at, self._pinged), name="unbroken-agent-ping"
        )
        self.answerer.start()
        self.timeline.add(
            "launch",
            f"node agent {self.id}: node {self.slot} of {self.nodes} ({self.local} rank(s) "
            f"each), coordinator {where}, heartbeat timeout {self.timeout:g} s",
            node=self.slot,
        )

    def _join(self) -> None:
        """Join the coordinator's job: its shape, spares, a node slot, its news."""
        job = json.dumps({"nnodes": self.nodes, "nproc_per_node": self.local})
        have = self.store.compare_set(contract.JOB_KEY, "", job).decode()
        if json.loads(have) != json.loads(job):
            raise SystemExit(
                f"unbroken run: the coordinator at {self.where} runs a job of "
                f"{have}, this agent was started for {job}: use the same --nnodes and "
                "--nproc-per-node on every node (or another coordinator)"
            )
        if self.opts.ours.warm_spare:
            # Ready before the slot is: an agent without --node-rank is a standby or a
            # replacement node, whose ranks all start at once: one spare for each.
            self.spares = Spares(self.store, self.base_env, self.script_argv())
            self.spares.start(self.local if self.wanted is None else 1)
        self.news = Listener(self.host, self.port)  # first: a standby waits on it for a slot
        self.slot = self._claim(self.news)
        announce(self.store)

    def _claim(self, news: Listener) -> int:
        """Claim ``--node-rank``'s slot, or the first free one; wait while none is free
        (a replacement may start before its predecessor is declared lost)."""
        slots = range(self.nodes) if self.wanted is None else [self.wanted]
        # Any slot: a standby, which waits for a lost node as long as the job runs.
        deadline = time.monotonic() + (math.inf if self.wanted is None else CLAIM_WAIT_S)
        done = [contract.slot_key(s, contract.DONE_SUFFIX) for s in range(self.nodes)]
        while time.monotonic() < deadline:
            if self.store.check(done):
                say("the job finished while this agent waited for a node slot")
                raise SystemExit(0)  # cleanup() then says the coordinator may go
            for slot in slots:
                key = contract.slot_key(slot, "owner")
                if self.store.compare_set(key, "", self.id).decode() == self.id:
                    self._wait_no_more()
                    return slot
            if not self.standby:
                say(f"node slot(s) {list(slots)} taken: waiting for one to be free")
                self.store.add(contract.STANDBY_KEY, 1)
                self.standby = True
            news.changed.wait(LOOK_S)  # the coordinator announces a freed slot at once
            news.take()
        raise SystemExit(f"unbroken run: no node slot of {list(slots)} came free in time")

    def _wait_no_more(self) -> None:
        if self.standby:
            self.standby = False
            self.store.add(contract.STANDBY_KEY, -1)

    def _pinged(self) -> None:
        self.fast_until = time.monotonic() + FAST_FOR_S

    # -- the drive loop's calls

    def pause(self, usual: float) -> None:
        """Between two polls of the drive loop: ``usual``, or `FAST_POLL_S` in a recovery;
        an announcement in the store ends it at once."""
        wait = FAST_POLL_S if time.monotonic() < self.fast_until else usual
        assert self.news is not None  # made by `start`, before the drive loop's first pause
        self.news.changed.wait(wait)

    def poll(self) -> bool:
        if self.stopping:
            return bool(self.live_pids())
        try:
            return self._poll()
        except (RuntimeError, OSError) as e:  # the store: the coordinator (or etcd) is gone
            self.give_up(
                first_line(e)
                if listen.is_etcd(self.host)
                else f"lost the coordinator at {self.where} ({first_line(e)}); restart "
                "`unbroken coordinator` there, then the job"
            )
            return bool(self.live_pids())

    def _poll(self) -> bool:
        """The local ranks at every call; the store only when something was announced,
        while probing a hang, or every `LOOK_S` (a change nobody announced). Not every
        `FAST_POLL_S` in a recovery: at 288 nodes that was 50,000 requests a recovery."""
        now = time.monotonic()
        look = (
            (self.news is not None and self.news.take())
            or self.probing is not None
            or now - self.looked >= LOOK_S
        )
        if look:
            self.looked = now
            owner = self.store.get(contract.slot_key(self.slot, "owner")).decode()
            if owner != self.id:
                self.give_up(f"the coordinator gave node slot {self.slot} to another agent")
                return True
            self._follow()
        self.check_workers()
        if look or (self.news is not None and self.news.changed.is_set()):
            self._handle_abort()  # this agent's own abort too, in the same call
        self.replenish()
        if self.workers and all(w.done for w in self.workers.values()):
            # Before the coordinator may exit: no beat, and no spare, into a void.
            self._stop_beating()
            if self.spares is not None:
                self.spares.stop()
            self.store.set(contract.slot_key(self.slot, contract.DONE_SUFFIX), self.id)
            announce(self.store)
            return False
        return True

    def _follow(self) -> None:
        """Start the ranks the coordinator asks for once it starts a new generation."""
        g = int(self.store.add(contract.GENERATION_KEY, 0))
        key = contract.generation_key(g, contract.SPAWN_KEY, self.id)
        if g <= self.generation or not self.store.check([key]):
            return
        if g > self.opts.max_restarts:
            self.give_up(
                f"generation {g}: the {self.opts.max_restarts} recoveries that "
                "--max-restarts allows are used up"
            )
            return
        ranks = json.loads(self.store.get(key))
        self.generation, self.generation_t = g, time.time()
        self.dead -= set(ranks)
        if g:
            self.timeline.add(
                "generation", f"generation {g}: starting ranks {ranks}", generation=g, ranks=ranks
            )
        for rank in ranks:
            self.spawn(rank, g)
        if self.dead:  # lost after this agent settled: the new generation fails at once
            self._abort(sorted(self.dead), hang=False)

    def _handle_abort(self) -> None:
        g = self.generation
        if g < 0 or self.seen_abort >= g:
            return
        key = f"{contract.ABORT_KEY}-{g}"
        if not self.store.check([key]):
            return
        self.fast_until = time.monotonic() + FAST_FOR_S
        reason = json.loads(self.store.get(key))
        if self.noted < g and reason.get("node", self.slot) != self.slot:
            self.noted = g
            self.timeline.remote_failure(reason, g)  # the summary names it
        if reason.get("hang") and self.probing is None:
            self.probing = (g, time.monotonic() + PROBE_S)
        if self.probing is not None:
            self.probe()
            if self.probing is not None:
                return
        self.seen_abort = g
        self._settle()

    def _settle(self) -> None:
        key = contract.generation_key(self.generation, contract.SETTLED_KEY, self.id)
        self.store.set(key, json.dumps(sorted(self.dead)))
        announce(self.store)

    # -- the Supervisor's recovery, per node

    def recover(self, ranks: list[int]) -> None:
        ranks = [r for r in ranks if r not in self.dead]
        if not ranks:
            return
        finished = [w.rank for w in self.workers.values() if w.done]
        if finished:
            self.give_up(
                f"ranks {ranks} failed after ranks {finished} finished: they cannot "
                "be replaced in-process; run again without --in-process"
            )
            return
        self.dead |= set(ranks)
        if self.seen_abort >= self.generation:
            self._settle()  # lost during a recovery: say so again
        else:
            self._abort(ranks, hang=False)

    def probe(self) -> None:
        """`Supervisor.probe`, without starting a generation: the coordinator does."""
        if self.probing is None:
            return
        generation, deadline = self.probing
        answered = self.answered(generation)
        live = {w.rank: w for w in self.workers.values() if w.proc and w.proc.poll() is None}
        silent = sorted(set(live) - answered - {w.rank for w in self.workers.values() if w.done})
        if silent and answered & set(live):
            deadline = min(deadline, time.monotonic() + supervisor.PROBE_S)
            self.probing = (generation, deadline)
        if silent and time.monotonic() < deadline:
            return
        self.probing = None
        self.watch.hold_off()
        for rank in silent:
            proc = live[rank].proc
            assert proc is not None
            self.kill_hung(rank, proc, "it is replaced alone")
            proc.wait()
            self.watch.saw_exit(proc.pid)
            self.dead.add(rank)

    def on_hang(self, stale: list[Stale], now: float) -> None:
        ranks = sorted(s.rank for s in stale)
        self.timeline.add(
            "hang_detected",
            f"ranks {ranks} made no progress: aborting "
            f"generation {self.generation} to find the hung one(s)",
            ranks=ranks,
        )
        self._abort([], hang=True)
        self.watch.hold_off()

    def _abort(self, ranks: list[int], hang: bool) -> None:
        reason = json.dumps({"failed": ranks, "node": self.slot, "hang": hang})
        self.store.compare_set(f"{contract.ABORT_KEY}-{self.generation}", "", reason)
        announce(self.store)

    def kill_node(self, node: int) -> None:
        """A kill-node fault for this node: it dies as a machine does, agent, ranks,
        spares and its shared memory (if it has a directory of its own) at once."""
        self.timeline.add("node_kill_requested", f"killing node {node}: this agent", node=node)
        self.stopped.set()  # a machine that dies stops beating first of all
        if os.environ.get(contract.MEMORY_DIR_ENV):
            shutil.rmtree(self.memory_dir, ignore_errors=True)
        for pid in descendants(os.getpid()):
            kill_tree(pid)
        os.kill(os.getpid(), signal.SIGKILL)

    def replenish(self) -> None:
        owed = self.spares is not None and self.spares.owed > 0
        if (
            owed
            and self.workers
            and all(w.generation <= self.generation for w in self.workers.values())
        ):
            mine = {w.rank for w in self.workers.values()}
            if set(self.reached("first_step", self.generation)) >= mine:
                assert self.spares is not None
                self.spares.replenish()

    def cleanup(self) -> None:
        super().cleanup()
        self._stop_beating()
        with contextlib.suppress(Exception):  # the coordinator may be gone
            self._wait_no_more()  # last: the spares, which use the store, are gone

    def _stop_beating(self) -> None:
        self.stopped.set()
        if self.news is not None:
            self.news.stop(self.store)
        if self.beater is not None:
            self.beater.join()
        if self.answerer is not None and self.answerer.is_alive():
            with contextlib.suppress(Exception):  # wake it: it sees `stopped` and ends
                ping(self.store, self.id)
            self.answerer.join(timeout=5.0)

    def since(self, beat: float, attempt: int) -> float:
        if attempt >= self.generation:
            return beat
        return max(beat, self.generation_t + self.timeout)
