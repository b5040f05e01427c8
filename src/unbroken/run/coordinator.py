"""``unbroken coordinator``: the store and the referee of a multi-node in-process job.

    unbroken coordinator --port 29400          # on a machine that is not a training node
    unbroken coordinator --etcd etcd://e0:2379,e1:2379,e2:2379/job-1   # or: the store in etcd
    unbroken run --in-process --nnodes 2 --nproc-per-node 8 \\
        --rdzv-endpoint coordinator:29400 --rdzv-id job-1 train.py   # on every node

Why a coordinator outside the training nodes, rather than a store that moves when its
host dies: every worker and node agent already talks to one TCPStore (generation, abort
keys, process-group rendezvous), and a store that migrates needs a consensus between the
survivors about where it went, at the very moment one of them is gone. A small process
that holds no training state (a few keys, no tensors), restarted by Kubernetes like any
Deployment, is simpler and sound: losing any training node, the one holding rank 0
included, loses nothing the coordinator holds. It plays the part HyperPod's operator
plays. Hosting the store itself (the default), it cannot survive its own loss: then
the workers' `in_process` raises `InProcessError` and the job restarts (plain ``unbroken
run`` semantics). With ``--etcd`` the store is an etcd cluster (`unbroken.run.etcd`):
the coordinator keeps nothing the store does not hold (`Coordinator.resume`), holds the
lead on an etcd lease while it decides, and its loss stops no rank: a standby
coordinator, or one restarted anywhere, takes over where the store says the job stands.

What it decides, and nothing else (the node agents, `unbroken.run.agent`, do the rest):

* node slots: an agent claims slot ``n`` (its node rank) with a compare-and-set on
  ``unbroken/slot-<n>/owner``; ranks ``n*L .. n*L+L-1`` are that slot's;
* node loss: each agent bumps a counter of its own every `unbroken.run.silence.BEAT_S`,
  on a thread of its own. The coordinator reads every counter in one request every
  50 ms; an agent silent for ``--ping-after`` (0.4 s) is pinged, and its node is lost if
  the ping is not answered within ``--answer-timeout`` (0.25 s): a machine that stops
  without closing its connections (a hung kernel, a cut network, SIGSTOP) is found in
  well under a second, while a live agent on a loaded CPU answers and stays
  (`unbroken.run.silence`). A slot whose counter has not moved for ``--node-timeout`` is
  lost in any case. A lost node's generation is aborted and its slot freed for a
  replacement; its ranks and agent, should they wake up, find the slot given away and
  leave (`unbroken.run.inprocess._fence`);
* sooner, on a worker's word: a worker whose collective failed on a lost peer (its
  connection closed: the peer's process or machine is gone) appends its rank to
  ``unbroken/suspect-<g>``. The coordinator then pings every agent
  (``unbroken/agent-<id>/ping-<n>``, which the agent waits on and answers with a beat)
  and declares lost, after ``--suspect-timeout``, every node whose agent has not beaten
  since and none of whose ranks reported: a dead machine is found at once, while a live
  agent answers a ping that reaches it in milliseconds;
* generations: generation 0 starts once every slot has an agent; after an abort of
  generation g, generation g+1 starts once every slot again has a live agent and every
  agent of g still alive has said which of its ranks it lost (``settled``). Each agent is
  told which ranks to start (``spawn``): the ones it lost, or all of a new node's.
"""

from __future__ import annotations

import gc
import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from unbroken.run import contract, gate, listen
from unbroken.run.listen import LOOPBACK
from unbroken.run.news import Listener, announce, heal
from unbroken.run.silence import DEFAULT, Beats, Silence, Verdict, ping

POLL_S = 0.02
LOOK_S = 0.5  # at most this long between two looks at the store when nothing is announced
NODE_TIMEOUT_S = 2.0
SUSPECT_TIMEOUT_S = 0.2
# --exit-when-done: how long the coordinator waits, at most, for the agents still waiting
# for a node slot (standbys) to see that the job is over before it exits (all of it only
# if one of them died waiting: it never says it saw the end).
STANDBY_WAIT_S = 10.0


def log(message: str) -> None:
    print(f"unbroken coordinator: {message}", file=sys.stderr, flush=True)


class Coordinator:
    """The coordinator's state over its own ``store`` (it is the store's master)."""

    def __init__(
        self,
        store: Any,
        node_timeout: float = NODE_TIMEOUT_S,
        suspect_timeout: float = SUSPECT_TIMEOUT_S,
        silence: Silence = DEFAULT,
    ) -> None:
        self.store = store
        self.node_timeout = node_timeout
        self.suspect_timeout = min(suspect_timeout, node_timeout)
        self.silence = silence
        self.nnodes = 0
        self.local = 0
        self.generation = 0
        self.started = False
        self.members: dict[int, str] = {}  # slot -> agent of the running generation
        self.beats = Beats()
        self.watched: dict[int, str] = {}  # slot -> agent, from the last look: beats read
        self.felt = -math.inf  # when the beats were read last
        self.aborted = False
        self.suspected: float | None = None  # when a worker of this generation reported
        # Between announcements (`unbroken.run.news`), look at the slots only every
        # look_s; the beats are read every silence.look_s (`_feel`).
        self.news: Listener | None = None
        self.look_s = min(LOOK_S, node_timeout / 4)
        self.looked = -math.inf
        self.healed = 0  # the news counter when `heal` last ran

    def resume(self) -> None:
        """Start where the store says the job stands: a coordinator that took over from
        one that died (`serve` with etcd) goes on with its generation, and ends a start
        it left half done; a new job's store says generation 0, not started."""
        self.generation = int(self.store.add(contract.GENERATION_KEY, 0))
        members = f"{contract.MEMBERS_KEY}-{self.generation}"
        if not self.store.check([members]):
            return
        self.members = {int(s): a for s, a in json.loads(self.store.get(members)).items()}
        self.started = True
        started = f"{contract.STARTED_KEY}-{self.generation}"
        if self.generation and not self.store.check([started]):
            self.store.set(started, "")
            announce(self.store)
        log(f"took over at generation {self.generation}, node(s) {sorted(self.members)}")

    def poll(self) -> bool:
        """Look at the store if something was announced, a start or a recovery is under
        way, or `look_s` passed; False once every node reported its ranks done."""
        now = time.monotonic()
        if self.watched and now - self.felt >= self.silence.look_s:
            self.felt = now
            self._feel(now)
        busy = not self.started or self.aborted or self.suspected is not None
        changed = self.news is not None and self.news.take()
        if not (changed or busy or now - self.looked >= self.look_s):
            return True
        self.looked = now
        self.healed = heal(self.store, self.healed)
        return self._look()

    def _look(self) -> bool:
        if not self.nnodes:
            if not self.store.check([contract.JOB_KEY]):
                return True
            job = json.loads(self.store.get(contract.JOB_KEY))
            self.nnodes, self.local = int(job["nnodes"]), int(job["nproc_per_node"])
            log(f"job: {self.nnodes} node(s) x {self.local} rank(s)")
        done = [self._key(s, contract.DONE_SUFFIX) for s in range(self.nnodes)]
        if self.store.check(done):
            log("every node finished")
            return False
        now = time.monotonic()
        owners = self._owners(now)
        if not self.started:
            if len(owners) == self.nnodes:
                self._start(owners, {})
                announce(self.store)
            return True
        if not self.aborted:
            self.aborted = self.store.check([self._abort_key()])
            if not self.aborted:
                self._suspect(owners, now)
        if self.aborted and len(owners) == self.nnodes and self._settled(owners):
            self._next(owners)
        return True

    def _key(self, slot: int, what: str) -> str:
        return contract.slot_key(slot, what)

    def _abort_key(self) -> str:
        return f"{contract.ABORT_KEY}-{self.generation}"

    def _owners(self, now: float) -> dict[int, str]:
        """The slots held by a live agent; frees (and reports) those whose agent is gone."""
        owners: dict[int, str] = {}
        for slot in range(self.nnodes):
            key = self._key(slot, "owner")
            if not self.store.check([key]) or self.store.check([self._key(slot, "done")]):
                continue
            agent = self.store.get(key).decode()
            self.beats.saw(agent, int(self.store.add(contract.agent_beat_key(agent), 0)), now)
            if now - self.beats.moved(agent) > self.node_timeout:
                self._lose(slot, agent, f"silent for {now - self.beats.moved(agent):.1f} s")
                continue
            owners[slot] = agent
        self.watched = dict(owners)
        return owners

    def _feel(self, now: float) -> None:
        """Read every watched agent's beat (one request): ping the silent ones, lose
        those that did not answer their ping (`unbroken.run.silence`)."""
        watched = list(self.watched.items())
        counts = self.store.multi_get([contract.agent_beat_key(a) for _, a in watched])
        for (slot, agent), count in zip(watched, counts, strict=True):
            if (silent := self.beats.saw(agent, int(count), now)) is not None:
                log(f"node {slot} (agent {agent}) answered a ping after {silent:.2f} s silent")
            verdict = self.beats.judge(self.silence, agent, now)
            if verdict is Verdict.PING:
                ping(self.store, agent)
                self.beats.pinged(agent, now)
            elif verdict is Verdict.LOST and self._holds(slot, agent):
                why = f"silent for {now - self.beats.moved(agent):.2f} s and did not answer a ping"
                self._lose(slot, agent, f"{why} within {self.silence.answer_s:g} s")

    def _holds(self, slot: int, agent: str) -> bool:
        """Whether ``agent`` still holds ``slot`` and is not done (an agent stops beating
        just before it says its node is done)."""
        owner, done = self._key(slot, "owner"), self._key(slot, contract.DONE_SUFFIX)
        if self.store.check([done]) or not self.store.check([owner]):
            return False
        return bool(self.store.get(owner).decode() == agent)

    def _suspect(self, owners: dict[int, str], now: float) -> None:
        """Act on workers' reports of a lost peer in the running generation: ping every
        agent, then lose the nodes with neither a beat since nor a reporting rank."""
        key = f"{contract.SUSPECT_KEY}-{self.generation}"
        if self.suspected is None:
            if self.store.check([key]):
                self.suspected = now
                for agent in owners.values():
                    ping(self.store, agent)
            return
        if now - self.suspected < self.suspect_timeout:
            return
        ranks = self.store.get(key).decode().split(",")
        reported = {int(r) // self.local for r in ranks if r.strip()}
        for slot, agent in owners.items():
            if slot not in reported and self.beats.moved(agent) <= self.suspected:
                why = f"did not answer within {self.suspect_timeout:g} s after a peer was lost"
                self._lose(slot, agent, why)

    def _lose(self, slot: int, agent: str, why: str) -> None:
        log(f"node {slot} (agent {agent}) {why}: lost; slot {slot} is free")
        if self.started:  # first: a coordinator that dies in between leaves a silent slot
            failed = list(range(slot * self.local, (slot + 1) * self.local))
            reason = {"failed": failed, "node": slot, "hang": False, "lost": why}
            self.store.compare_set(self._abort_key(), "", json.dumps(reason))
        self.store.delete_key(self._key(slot, "owner"))
        self.beats.forget(agent)
        self.watched.pop(slot, None)
        announce(self.store)

    def _settled(self, owners: dict[int, str]) -> bool:
        keys = [
            contract.generation_key(self.generation, contract.SETTLED_KEY, agent)
            for slot, agent in owners.items()
            if self.members.get(slot) == agent
        ]
        return self.store.check(keys) if keys else True

    def _start(self, owners: dict[int, str], lost: dict[int, list[int]]) -> None:
        """Tell each agent which ranks to start in the current generation."""
        for slot, agent in owners.items():
            mine = list(range(slot * self.local, (slot + 1) * self.local))
            ranks = lost[slot] if self.members.get(slot) == agent else mine
            key = contract.generation_key(self.generation, contract.SPAWN_KEY, agent)
            self.store.set(key, json.dumps(ranks))
        # Last: a generation with members has every agent's orders (`resume`).
        self.store.set(f"{contract.MEMBERS_KEY}-{self.generation}", json.dumps(owners))
        self.members = dict(owners)
        self.started = True
        self.aborted = False
        self.suspected = None

    def _next(self, owners: dict[int, str]) -> None:
        lost: dict[int, list[int]] = {}
        for slot, agent in owners.items():
            if self.members.get(slot) == agent:
                key = contract.generation_key(self.generation, contract.SETTLED_KEY, agent)
                lost[slot] = json.loads(self.store.get(key))
        self.generation += 1
        self._start(owners, lost)
        new = sorted(s for s, a in owners.items() if s not in lost)
        # Not add(1): a request retried on another etcd member must not move it twice.
        self.store.compare_set(
            contract.GENERATION_KEY, str(self.generation - 1), str(self.generation)
        )
        self.store.set(f"{contract.STARTED_KEY}-{self.generation}", "")  # survivors wait on it
        announce(self.store)
        log(
            f"generation {self.generation}: ranks {sorted(r for v in lost.values() for r in v)} "
            f"restarted on their nodes, node(s) {new} joined"
        )


@dataclass(frozen=True)
class Where:
    """Where the job's store is: hosted on ``host:port`` (behind the gate where there is a
    ``secret``), or kept by the etcd cluster at the ``etcd`` URL."""

    host: str = LOOPBACK
    port: int = 29400
    secret: bytes | None = None
    etcd: str | None = None


def _host(where: Where) -> tuple[Any, str, int]:
    """The store, and the address of a client connection to it (for the `Listener`)."""
    if where.etcd is not None:
        from unbroken.run.etcd import EtcdStore

        return EtcdStore(where.etcd), where.etcd, 0
    if where.secret is None:
        store = listen.store(where.host, where.port)
        local = LOOPBACK if where.host in ("0.0.0.0", "::") else where.host
        print(f"unbroken coordinator: listening on {where.host}:{store.port}", flush=True)
        return store, local, store.port
    store = listen.store(LOOPBACK, 0)
    listening = gate.Gate(where.host, where.port, store.port, where.secret).port
    print(f"unbroken coordinator: listening on {where.host}:{listening}", flush=True)
    return store, LOOPBACK, store.port


def serve(
    where: Where,
    node_timeout: float = NODE_TIMEOUT_S,
    suspect_timeout: float = SUSPECT_TIMEOUT_S,
    exit_when_done: bool = False,
    silence: Silence = DEFAULT,
) -> int:
    """Decide for the job whose store is ``where``, until it is done (``exit_when_done``)
    or a signal. With etcd, only while this coordinator leads: another takes over where
    the store says the job stands (`Coordinator.resume`)."""
    from unbroken.run.etcd import Lead, LeadLost

    store, local, port = _host(where)
    lead = None
    if where.etcd is not None:
        lead = Lead(store)
        lead.take(log)
        store.fence(Lead.KEY, lead.lease)  # a write after the lead is lost is refused
        print(f"unbroken coordinator: leading the job at {where.etcd}", flush=True)
    coordinator = Coordinator(store, node_timeout, suspect_timeout, silence)
    coordinator.news = Listener(local, port)
    gc.freeze()  # no full collection of torch's heap in the loop (see unbroken.run.cli)
    stop = threading.Event()

    def stopping(sig: int, frame: FrameType | None) -> None:
        log(f"stopping (signal {sig})")  # an orderly stop: one line, no traceback
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stopping)
    try:
        coordinator.resume()
        while not stop.is_set() and (coordinator.poll() or not exit_when_done):
            if lead is not None and not lead.keep():
                raise LeadLost("its lease expired")
            time.sleep(POLL_S)
        deadline = time.monotonic() + STANDBY_WAIT_S
        # Standbys see the job's end and leave before the store does (unbroken.run.agent).
        while not stop.is_set() and int(store.add(contract.STANDBY_KEY, 0)) > 0:
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
    except LeadLost:
        log("lost the lead (its etcd lease expired): another coordinator decides now")
        return 1
    finally:
        coordinator.news.stop(store)
        if lead is not None:
            lead.release()
    return 0
