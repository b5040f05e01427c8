"""Recovery after a fault: time from the fault to the first completed step after it, and
the steps lost, for a traditional restart from disk against unbroken's memory tiers and
in-process recovery, each phase timed; then how process-group (re-)initialisation grows
with the number of ranks.

    python bench/recovery.py                      # 2 simulated nodes x 2 ranks, 256 MiB/rank
    python bench/recovery.py --mib-per-rank 16    # smoke, under 2 minutes
    python bench/recovery.py --scenarios ace      # a subset

Every scenario is one real job under ``unbroken run --simulate-nodes`` (each node with its
own shared-memory directory), on CPU with gloo. Each rank trains bench/recovery_worker.py:
8 large "expert" Linear layers (one per step, round robin) around a small trunk and head,
each part its own DDP, AdamW; parameters plus optimizer state come to --mib-per-rank on
every rank. Every scenario saves a disk checkpoint every --save-every steps with
``unbroken.Checkpointer`` (synchronous, fsynced) and injects its fault at --fault-step,
between two disk checkpoints:

(a) traditional: ``kill rank=1``; torchrun restarts every worker, which reload the last
    disk checkpoint (Checkpointer without memory) with a cold page cache: each restarted
    rank evicts the checkpoint's files (``posix_fadvise(DONTNEED)``, residency checked with
    ``mincore``) before any rank reads, then a barrier;
(b) same fault; snapshots in node-local shared memory every --memory-every steps; torchrun
    restarts every worker, which restore from their own node's memory;
(c) ``kill-node node=1`` (its ranks and its shared memory) under ``unbroken run
    --in-process --warm-spare``; snapshots also replicated to a peer on the other node
    (replicas=1): the healthy ranks keep their processes, abort their process groups and
    roll back from their own memory; standby processes (torch already imported) take the
    lost node's ranks and pull their state from the replicas. The target is for this one;
(d) the same node loss with unbroken's fallback: a replacement node joins, torchrun
    restarts every worker, the lost node's ranks restore from their peers' replicas;
(e) as (c) without warm spares: the lost node's ranks start as new interpreters;
(f), (g) across nodes (bench/recovery_multinode.py): an ``unbroken coordinator`` and one
    ``unbroken run --in-process`` node agent per node, each its own process tree with its
    own shared memory, plus a standby node agent with warm spares that claims the lost
    node's slot; the training calls ``Checkpointer.step`` every step (live healing, where
    the library has it); (f) loses another node, (g) the node holding rank 0. A healthy
    rank's report of the lost peer and the coordinator's ping find the lost node
    (--suspect-timeout, 0.2 s), the --node-timeout (1 s here) if nobody reports;
(i) as (f), but the node goes silent instead of dying: its agent, ranks and spares are
    SIGSTOPped after the fault step, no connection closes (a hung kernel, a cut network).
    The coordinator pings the agent whose beat is silent for --ping-after (0.4 s) and
    loses the node when the ping goes unanswered for --answer-timeout (0.25 s). Target:
    the next step within 2 s of the stop, no step lost;
(j) as (g), the job's store in a 3-member etcd cluster on loopback (tests/servers/etcd.py)
    with two ``unbroken coordinator --etcd``: the leading coordinator is killed together
    with node 0; the standby coordinator takes the lead once the leader's etcd lease
    expires (3 s) and the job heals live. Target: no step lost;
(k) as (f) with no standby node: a replacement node agent starts 65 s after the loss (a
    new pod on a busy cluster). The survivors hold their state and wait for it (20 minutes
    by default). Target: no survivor restarted, no step lost.

Restart-all across nodes ((d)): the "restart" phase is how long the surviving agent took
to drop the lost node from the rendezvous and restart its workers (keep-alive 2 x 1 s).

Phases, from the launcher's timeline (``--timeline-json``) and the workers' own event
logs, each boundary the moment the last rank passed it: detect (fault -> the launcher sees
the exit or the node loss), restart (-> the new worker processes started: torchrun stops
the survivors and re-rendezvous, or the supervisor respawns the lost ranks), startup (->
every rank entered process-group init: interpreter and imports for new processes),
PG init (-> ``init_process_group`` done), setup (-> Checkpointer and its group built;
plus the cache eviction in (a)), restore, first step (-> DDP wrappers built and every
rank completed a step); total = fault -> first step.
Lost steps: completed steps that had to be redone; "back at step N": fault -> every rank
has completed the fault step again. Step and snapshot: steady-state medians per rank
before the fault (training step with its all-reduce; time the loop waits in ``snapshot``).
A job that does not recover (the hang watchdog, --heartbeat-timeout, kills ranks that make
no progress; --max-restarts 2) is reported as such, with the launcher's reasons.

Scaling: for each world size in --scaling-ranks, that many forked processes (no state,
no interpreter start) connect to one TCPStore, then initialise the default gloo group and
a Checkpointer-style ``new_group`` --scaling-repeats times, each round on a fresh key
prefix, as a recovery that keeps its processes would. Times run from the last rank to
start to the last rank to finish; round 0 includes connecting to the store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from pathlib import Path

import recovery_moments
from common import disk_workdir, print_result
from recovery_jobs import run_scenario
from recovery_multinode import run_multinode_scenario
from recovery_report import report
from recovery_scaling import run_scaling
from recovery_scenarios import RecoveryConfig, scenarios
from unbroken.run.contract import SIM_MEMORY_ROOT


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SIM_MEMORY_ROOT))
    except FileNotFoundError:
        return set()


def main() -> None:
    parser, args = parse()
    scaling_ranks = tuple(int(n) for n in args.scaling_ranks.split(",") if n.strip())
    chosen = set(args.scenarios.replace(",", ""))
    if not chosen or chosen - set("abcdefgijk"):
        parser.error(f"--scenarios {args.scenarios!r}: pick from a to g and i to k")

    workdir = disk_workdir(parser, args.dir, "unbroken-recovery-")
    cfg = RecoveryConfig(
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        mib_per_rank=args.mib_per_rank,
        save_every=args.save_every,
        fault_step=args.fault_step,
        memory_every=args.memory_every,
        steps_after=args.steps_after,
        heartbeat_timeout=args.heartbeat_timeout,
        scaling_ranks=scaling_ranks,
        scaling_repeats=args.scaling_repeats,
        dir=workdir,
    )
    shm_before = shm_entries()
    started = time.monotonic()
    try:
        results = {}
        for sc in (sc for sc in scenarios(cfg) if sc.key in chosen):
            print(f"running {sc.label} ...", flush=True)
            run = run_multinode_scenario if sc.multinode else run_scenario
            results[sc.key] = run(cfg, sc)
            r = results[sc.key]
            if r["total_s"] is not None:
                print(f"  {r['total_s']:.2f} s from fault to first step, {r['lost_steps']} lost")
        scaling = []
        for n in scaling_ranks:
            print(f"process-group init, {n} ranks ...", flush=True)
            scaling.append(run_scaling(cfg, n))
        moments = None
        if args.moments:
            print(f"(h) a node killed at {args.moments} random moments ...", flush=True)
            moments = recovery_moments.run(args.moments, Path(workdir) / "moments")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        # The launcher removes each job's shared memory; anything a killed run left is ours.
        for name in shm_entries() - shm_before:
            shutil.rmtree(os.path.join(SIM_MEMORY_ROOT, name), ignore_errors=True)
        if not shm_before:
            with contextlib.suppress(OSError):
                os.rmdir(SIM_MEMORY_ROOT)  # ours, if empty
    summary = report(cfg, results, scaling, time.monotonic() - started)
    if moments is not None:
        recovery_moments.table(moments)
        summary["moments"] = moments
    print_result(summary)


def parse() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=float, default=256)
    parser.add_argument("--save-every", type=int, default=50, help="disk checkpoints")
    parser.add_argument("--fault-step", type=int, default=80)
    parser.add_argument("--memory-every", type=int, default=5, help="memory snapshots")
    parser.add_argument("--steps-after", type=int, default=5, help="steps run after the fault")
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=20.0,
        help="unbroken run's hang watchdog: a rank without progress this long is killed",
    )
    parser.add_argument(
        "--scenarios",
        default="abcdefgijk",
        help="which of a-g and i-k to run (default: all; (a) is the base)",
    )
    parser.add_argument(
        "--scaling-ranks",
        default="2,4,8",
        help="world sizes for the process-group measurement ('' to skip)",
    )
    parser.add_argument("--scaling-repeats", type=int, default=5)
    parser.add_argument(
        "--moments", type=int, default=0, help="(h): kills at random moments (50: ~20 min)"
    )
    parser.add_argument("--dir", help="on a real disk (default: a temp dir under /tmp or the repo)")
    args = parser.parse_args()
    if args.nodes < 2 or args.nproc_per_node < 1:
        parser.error("need --nodes >= 2 (a node is lost in (c)) and --nproc-per-node >= 1")
    if not 0 < args.save_every < args.fault_step or args.fault_step % args.save_every == 0:
        parser.error("--fault-step must fall after the first disk checkpoint, between two")
    if args.memory_every < 1 or args.steps_after < 1 or args.scaling_repeats < 2:
        parser.error("need --memory-every >= 1, --steps-after >= 1, --scaling-repeats >= 2")
    return parser, args


if __name__ == "__main__":
    main()
