"""Method (d) of bench/storm.py: torchft 0.2 on CPU with gloo, as its README runs it.

    python bench/storm_torchft.py --smoke   # a crash and a node loss, then a summary

A Lighthouse (``torchft_lighthouse``) and one one-rank replica group per data-parallel
rank, each under its own ``torchrun --nproc-per-node=1 --max-restarts=100``; a node holds
``per_node`` groups. Every group trains the job with ``torchft.Manager`` (gradients
all-reduced through ``manager.allreduce``, not torchft's DDP wrapper, which crashed the
survivor when a peer died mid-allreduce) and ``torchft.Optimizer``. Unlike the other
methods there is no checkpoint at all: a restarted group (torchrun restarts it after a
crash) heals from a live peer over torchft's HTTP transport, with the model, the
optimizer and the sampler's position; a lost node's groups are started again after the
replacement delay and heal the same way; a hung (SIGSTOPped) group stops heartbeating, so
the survivors' all-reduce fails after the gloo timeout (``--hang-timeout``), that step is
not committed, and the next quorum leaves the group out. The survivors never stop: a
step with fewer groups averages fewer gradients.

Choices beyond torchft's README, for the data position and a common start: the quorum
is synchronous (``use_async_quorum=False``), so a healing group loads its peer's state in
``zero_grad``, before it draws its batch (asynchronously it loads only in ``step``, and
the peer reads its sampler while its own loop draws the next batch); a step that does not
commit gives its batch back, so step k uses global batch k as in the reference;
``init_sync=False``, as every group builds the same seeded model; and at the job's first
start the groups wait for each other (`gather`), as the lighthouse would otherwise start
with the first group built and heal the others into it.

Seen on CPU: a crash or a node loss also stalls the survivors for about the gloo timeout,
as a survivor that was waiting on a live peer, not the dead one, goes on waiting after
that peer gave up the step. A replacement that arrives after the survivors finished finds nobody to
heal from and trains alone from step 0 (the driver's job is over by then).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import free_port
from storm_launch import Config, Launch, Procs, kill_tree, python, start
from storm_report import read as read_events

HERE = Path(__file__).resolve()


def launch(cfg: Config) -> Launch:
    """The lighthouse as the service, a node as its replica groups' torchruns."""
    lighthouse: dict[str, int] = {}  # its port, once started: every node's groups need it

    def services(out: Path) -> Procs:
        lighthouse["port"] = free_port()
        cmd = ["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100",
               "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", "1000",
               "--bind", f"127.0.0.1:{lighthouse['port']}"]  # fmt: skip
        return [start(out, "lighthouse", cmd)]

    def node(out: Path, n: int | None) -> Procs:
        assert n is not None, "torchft keeps no standby node"
        procs = []
        for g in range(n * cfg.per_node, (n + 1) * cfg.per_node):
            # One torchrun per replica group, its store on a port of its own.
            cmd = python(
                "-m", "torch.distributed.run", "--nproc-per-node=1", "--max-restarts=100",
                f"--master-port={free_port()}", str(HERE), "--trainer", f"--out={out}",
                f"--steps={cfg.steps}", f"--hang-timeout={cfg.hang_timeout}",
                f"--per-node={cfg.per_node}",
            )  # fmt: skip
            env = {"REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": str(cfg.ranks),
                   "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse['port']}"}  # fmt: skip
            procs.append(start(out, f"node{n}-group{g}", cmd, **env))
        return procs

    return Launch(
        key="d",
        label="torchft 0.2: replica groups, healed from a live peer",
        services=services,
        node=node,
        standby=False,
    )


def trainer(args: argparse.Namespace) -> None:
    """One replica group's only rank (under torchrun)."""
    import torch
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from storm_job import Events, batches, build_model, digest, loss_of, optimizer, sampler

    torch.set_num_threads(1)
    group, world = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    events = Events(args.out, rank=group, node=group // args.per_node)
    model = build_model()
    base = optimizer(model)
    dataset, order = sampler(args.out, rank=group, world=world)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": base.state_dict(), "data": order.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        base.load_state_dict(sd["optim"])
        order.load_state_dict(sd["data"])

    timeout = timedelta(seconds=args.hang_timeout)
    # Created once the model is built: the lighthouse waits for a group that heartbeats.
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load,
        state_dict=state,
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"group-{group}",
        timeout=timeout,
        init_sync=False,
    )
    optim = Optimizer(manager, base)
    gather(Path(args.out), group, world)
    restored = False
    while manager.current_step() < args.steps:
        optim.zero_grad()  # the quorum; a group that is behind heals here
        if not restored and manager.errored() is None:
            restored = True
            events("restored", step=manager.current_step())
        where = order.state_dict()
        # A fresh iterator each step: it starts where the sampler is, healed or not.
        loss = loss_of(model, next(batches(dataset, order)))
        loss.backward()
        works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
        for work in works:
            work.wait()
        before = manager.current_step()
        optim.step()  # commits only if this group's all-reduces succeeded
        if manager.current_step() > before:
            events("step", step=manager.current_step(), loss=loss.item(), ckpt_s=0.0)
        else:
            order.load_state_dict(where)  # the step is retried with the same batch
    events("final", step=manager.current_step(), digest=digest(model))
    manager.shutdown()


def gather(out: Path, group: int, world: int, timeout: float = 60.0) -> None:
    """At the job's first start, wait until every group's manager heartbeats: the
    lighthouse forms a quorum of the groups that heartbeat, so the first one built would
    train alone and the others heal into it (torchrun's rendezvous waits for the other
    methods)."""
    if (out / "stepped").exists():
        return  # a restart or a replacement: it heals from the groups training
    (out / f"built-{group}").touch()
    ends = time.time() + timeout
    while len(list(out.glob("built-*"))) < world and time.time() < ends:
        time.sleep(0.05)
    time.sleep(0.5)  # the last group's first heartbeats (every 0.1 s) reach the lighthouse


def wait_for(out: Path, done: Callable[[list[dict[str, Any]]], bool], timeout: float) -> None:
    ends = time.time() + timeout
    while not done(read_events(out)):
        if time.time() > ends:
            raise TimeoutError(f"gave up after {timeout:.0f} s; logs in {out}")
        time.sleep(0.2)


def past(step: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda events: any(e["event"] == "step" and e["step"] > step for e in events)


def smoke() -> None:
    """A crash of group 3 (torchrun restarts it), then the loss and replacement of node 1."""
    cfg = Config(steps=300, every=0, seed=0)  # a replaced node finds peers
    out = Path(tempfile.mkdtemp(prefix="storm-torchft-"))
    method = launch(cfg)
    procs = method.services(out)
    nodes = {n: method.node(out, n) for n in range(cfg.nodes)}
    faults: dict[str, float] = {}
    try:
        wait_for(out, past(40), 180)
        os.kill(int((out / "pids" / "rank-3").read_text()), signal.SIGKILL)
        faults["crash"] = time.time()
        wait_for(out, lambda es: past(80)(es) and restarts(es, 3, faults["crash"]), 120)
        for proc in nodes[1]:
            kill_tree(proc)
        faults["node"] = time.time()
        time.sleep(3.0)
        nodes[1] = method.node(out, 1)
        finals = {f"final-{g}" for g in range(cfg.ranks)}
        wait_for(out, lambda _: finals <= {p.name for p in out.iterdir()}, 240)
    finally:
        for proc in [*procs, *(p for ps in nodes.values() for p in ps)]:
            kill_tree(proc)
    summary(read_events(out), faults, cfg.ranks)
    print(f"logs in {out}")


def restarts(events: list[dict[str, Any]], rank: int, since: float) -> bool:
    """Whether ``rank`` committed a step in a process started after ``since``."""
    return any(e["event"] == "step" and e["rank"] == rank and e["t"] > since for e in events)


def summary(events: list[dict[str, Any]], faults: dict[str, float], ranks: int) -> None:
    t0 = min(e["t"] for e in events)
    steps = [e for e in events if e["event"] == "step" and e["rank"] == 0]
    gaps = sorted(b["t"] - a["t"] for a, b in itertools.pairwise(steps))
    print(f"group 0's step: median {gaps[len(gaps) // 2]:.3f} s, longest {gaps[-1]:.1f} s")
    for g in range(ranks):
        mine = [e for e in events if e["rank"] == g]
        final = next((e for e in mine if e["event"] == "final"), {})
        restored = [(e["step"], round(e["t"] - t0, 1)) for e in mine if e["event"] == "restored"]
        print(f"group {g}: restored (step, t) {restored}, "
              f"{sum(e['event'] == 'step' for e in mine)} steps logged, "
              f"final step {final.get('step')} digest {final.get('digest')}")  # fmt: skip
    for kind, at in faults.items():
        hit = [3] if kind == "crash" else [2, 3]
        for g in hit:
            after = [e for e in events if e["rank"] == g and e["t"] > at]
            first = {e["event"]: e for e in reversed(after)}  # each event's first
            took = [f"{k} +{first[k]['t'] - at:.1f} s" for k in ("start", "restored", "step")
                    if k in first]  # fmt: skip
            step = first.get("restored", {}).get("step")
            print(f"{kind} at t={at - t0:.1f} s: group {g} {', '.join(took)} (from step {step})")
    digests = {e["digest"] for e in events if e["event"] == "final"}
    print(f"final digests agree: {len(digests) == 1} {sorted(digests)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a crash and a node loss on 4 groups")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=150, help=argparse.SUPPRESS)
    p.add_argument("--hang-timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--per-node", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer:
        trainer(args)
    elif args.smoke:
        smoke()
    else:
        p.print_help()


if __name__ == "__main__":
    main()
