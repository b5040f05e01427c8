"""The scenarios of bench/recovery.py: the run's settings, and for each scenario the fault
it injects, the memory tiers its job keeps and the launcher options it runs under."""

from __future__ import annotations

from dataclasses import dataclass, replace

LATE_S = 65.0  # (k): the replacement node's start, as measured on a busy cluster

PHASES = [
    ("detect", "detect"),
    ("restart", "restart"),
    ("startup", "startup"),
    ("pg_init", "PG init"),
    ("setup", "setup"),
    ("restore", "restore"),
    ("first_step", "first step"),
]


@dataclass(frozen=True)
class RecoveryConfig:
    nodes: int
    nproc_per_node: int
    mib_per_rank: float
    save_every: int
    fault_step: int
    memory_every: int
    steps_after: int
    heartbeat_timeout: float
    scaling_ranks: tuple[int, ...]
    scaling_repeats: int
    dir: str

    @property
    def ranks(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def steps(self) -> int:
        return self.fault_step + self.steps_after


@dataclass(frozen=True)
class Scenario:
    key: str
    short: str  # for the table
    label: str
    fault: str
    memory_every: int
    replicas: int
    cold: bool = False
    multinode: bool = False  # a coordinator and one node agent per node (recovery_multinode)
    live: bool = False  # the worker calls Checkpointer.step every step
    stop: bool = False  # multinode: the node is SIGSTOPped (silent), not killed
    etcd: bool = False  # multinode: the store in etcd; the leading coordinator dies too
    late_s: float = 0.0  # multinode: the standby node agent starts this long after the loss
    launcher: tuple[str, ...] = ()  # options of `unbroken run` beyond the common ones

    @property
    def in_process(self) -> bool:
        return "--in-process" in self.launcher


def scenarios(cfg: RecoveryConfig) -> list[Scenario]:
    kill = f"kill rank=1 step={cfg.fault_step}"
    node = f"kill-node node={cfg.nodes - 1} step={cfg.fault_step}"
    every = cfg.memory_every
    return [
        Scenario(
            "a",
            "(a) traditional: restart all, last disk checkpoint, cold cache",
            "(a) traditional: restart all workers, reload the last disk checkpoint, cold cache",
            kill,
            memory_every=0,
            replicas=0,
            cold=True,
        ),
        Scenario(
            "b",
            "(b) restart all, own shared memory",
            "(b) unbroken: restart all workers, restore from own shared memory",
            kill,
            memory_every=every,
            replicas=0,
        ),
        Scenario(
            "c",
            "(c) node lost: in-process, warm spares",
            "(c) unbroken: node lost, in-process recovery (healthy ranks stay up and roll back "
            "from their own memory; warm spares take the lost node's ranks and pull their "
            "state from peer replicas)",
            node,
            memory_every=every,
            replicas=1,
            launcher=("--in-process", "--warm-spare"),
        ),
        Scenario(
            "d",
            "(d) node lost: restart all, peer replicas",
            "(d) unbroken's fallback: node lost, restart all workers, restore from own memory "
            "+ peer replicas",
            node,
            memory_every=every,
            replicas=1,
        ),
        *multinode(cfg),
        Scenario(
            "e",
            "(e) node lost: in-process, cold replacements",
            "(e) as (c) without warm spares: the lost node's ranks start as new processes",
            node,
            memory_every=every,
            replicas=1,
            launcher=("--in-process",),
        ),
    ]


def multinode(cfg: RecoveryConfig) -> list[Scenario]:
    """(f), (g), (i), (j), (k): one ``unbroken run --in-process`` node agent per node and
    an ``unbroken coordinator``, plus a standby node agent (warm spares) that takes the
    lost slot; (i) stops its node instead of killing it, (j) runs on etcd and (k) starts
    the standby only `LATE_S` after the loss."""
    f, g = (
        Scenario(
            key,
            f"({key}) multi-node in-process, live, lost: {what}",
            f"({key}) unbroken across nodes: {what} lost (node {node}); one node agent "
            "per node and a coordinator; a standby node agent with warm spares takes the "
            "free slot; live healing (Checkpointer.step every step) plus replicas",
            f"kill-node node={node} step={cfg.fault_step}",
            memory_every=cfg.memory_every,
            replicas=1,
            multinode=True,
            live=True,
            launcher=("--in-process", "--warm-spare"),
        )
        for key, node, what in (
            ("f", cfg.nodes - 1, "another node"),
            ("g", 0, "the node of rank 0"),
        )
    )
    node = cfg.nodes - 1
    i = replace(
        f,
        key="i",
        short="(i) multi-node in-process, live, silent: a node stopped",
        label=f"(i) as (f), but node {node} goes silent instead of dying: its agent, ranks "
        "and spares are SIGSTOPped, no connection closes (a hung kernel, a cut network); "
        "the coordinator pings the silent agent and loses the node when it does not answer",
        fault=f"SIGSTOP of node {node}'s process tree after step {cfg.fault_step}",
        stop=True,
    )
    j = replace(
        g,  # and the leading coordinator, then
        key="j",
        short="(j) multi-node on etcd, live: rank 0's node and the coordinator lost",
        label="(j) as (g), the store in a 3-member etcd cluster: node 0 and the leading "
        "coordinator die together; the standby coordinator takes the lead (its etcd "
        "lease expires in 3 s) and the lost node heals live",
        etcd=True,
    )
    k = replace(
        f,
        key="k",
        short=f"(k) multi-node in-process, live, replacement after {LATE_S:g} s",
        label=f"(k) as (f), but no standby node: a replacement node agent starts {LATE_S:g} "
        "s after the loss, as a new pod does on a busy cluster; the survivors hold their "
        "state and wait for it",
        late_s=LATE_S,
    )
    return [f, g, i, j, k]
