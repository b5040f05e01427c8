"""The training job of bench/recovery.py, run by ``unbroken run`` (torchrun) on every rank.

A small trunk and head around 8 large "expert" Linear layers (one per step, round robin),
each part its own DDP, trained with AdamW; parameters plus optimizer state come to
--mib-per-rank. A disk checkpoint every --save-every steps (``unbroken.Checkpointer``,
synchronous); with --memory-every N > 0, a shared-memory snapshot every N steps (tier 0)
and --replicas copies on peers of other nodes (tier 1). It restores at start, from
wherever the Checkpointer finds the newest state, after evicting the checkpoint's pages
from the page cache with --cold. Under ``unbroken run --in-process`` a healthy rank runs
the loop again, in the same process, after a peer fails (`unbroken.run.in_process`).

Each process appends JSON lines (wall-clock ``t``) to ``--out/events-<rank>-<pid>.jsonl``;
the bench reads them next to the launcher's timeline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import unbroken
from unbroken import run
from unbroken.data import ResumableSampler, TokenDataset
from unbroken.data.files import sidecar
from unbroken.demo.model import tokenise_corpus
from unbroken.run import contract

EXPERTS = 8
IO = 64  # input and output features
MIB = 1 << 20
BATCH = 16
WIDTH_MULTIPLE = 64


class Events:
    """This process's event log: one JSON line per event, appended whole. ``call``
    counts the calls of `train` in this process (more than one under in-process
    recovery, where a healthy rank trains again after a peer failed)."""

    def __init__(self, out: str) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.node = os.environ.get(contract.NODE_ENV)
        self.path = os.path.join(out, f"events-{self.rank}-{os.getpid()}.jsonl")
        self.call = -1

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": time.time(), "rank": self.rank, "pid": os.getpid()}
        record.update(call=self.call, node=self.node, **fields)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def width_for(mib: float) -> int:
    """Width of the experts such that parameters + AdamW's two moments (12 bytes per fp32
    parameter) come to about ``mib`` MiB."""
    per_expert = mib * MIB / 12 / EXPERTS
    return max(WIDTH_MULTIPLE, round(math.sqrt(per_expert) / WIDTH_MULTIPLE) * WIDTH_MULTIPLE)


class Model(nn.Module):
    """A small trunk and head around ``EXPERTS`` large square layers, one of which (round
    robin by step) every step goes through: most of the state is memory, a step is cheap.

    Built once per process: under in-process recovery a healthy rank keeps its model and
    optimizer, and only rolls their values back. What holds a process group (`Parallel`,
    the Checkpointer) is built anew in each generation."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(IO, width), nn.Tanh())
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(EXPERTS)
        )
        self.head = nn.Linear(width, IO)


class Parallel:
    """Each part of ``model`` its own DistributedDataParallel, so a step all-reduces the
    gradients of the parts it used only, and AdamW updates only those (the others have
    no gradient). ``sync``: broadcast rank 0's parameters first (not needed right after
    a restore, which gave every rank the same values)."""

    def __init__(self, model: Model, sync: bool) -> None:
        self.trunk = DistributedDataParallel(model.trunk, init_sync=sync)
        self.experts = [DistributedDataParallel(e, init_sync=sync) for e in model.experts]
        self.head = DistributedDataParallel(model.head, init_sync=sync)

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.trunk(x)
        h = h + self.experts[step % EXPERTS](h)
        out: torch.Tensor = self.head(h)
        return out


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data that depends on the step and rank only (bench/recovery_torchft.py's; this
    worker reads the token file of `data` instead)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IO, generator=g)
    return x, torch.tanh(x.flip(1))  # a fixed function to learn: the loss goes down


def data(out: str) -> tuple[TokenDataset, ResumableSampler]:
    """The shipped corpus, tokenised once per rank into ``out`` (a restarted process
    re-attaches to the memory-mapped file), in the order of a ResumableSampler that is
    checkpointed with the model: a redone step sees the same batch."""
    path = os.path.join(out, f"tokens-{dist.get_rank()}.bin")
    if not os.path.exists(sidecar(path)):
        tokenise_corpus(Path(path))
    # The corpus eight times over: enough samples for a global batch on 58 ranks.
    dataset = TokenDataset([path] * 8, seq_len=IO)
    return dataset, ResumableSampler(dataset, BATCH, seed=0)


def batches(dataset: TokenDataset, sampler: ResumableSampler) -> Iterator[tuple[Tensor, Tensor]]:
    """Token windows as features in [-1, 1), and the same fixed function to learn."""
    while True:
        for indices in sampler:
            x = torch.stack([dataset[i][:IO] for i in indices]).float() / 128 - 1
            yield x, torch.tanh(x.flip(1))


def train(args: argparse.Namespace, log: Events, state: dict[str, Any]) -> None:
    """One generation of the training loop on the default process group, which
    `unbroken.run.in_process` set up."""
    log.call += 1
    model = state["model"]
    memory = args.memory_every > 0
    ckpt = unbroken.Checkpointer(
        args.ckpt, memory=memory, replicas=args.replicas, keep=2, timeout=120
    )
    params = sum(p.numel() for p in model.parameters())
    dataset, state["data"] = data(args.out)
    log("setup_done", state_mib=12 * params / MIB)
    restored = restore(args, log, ckpt, state)
    if restored is None:
        torch.manual_seed(0)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
    net = Parallel(model, sync=restored is None)
    loss = loop(args, log, ckpt, state, net, restored, batches(dataset, state["data"]))
    ckpt.close()
    log("done", step=state["progress"].step, loss=loss.item())


def restore(
    args: argparse.Namespace, log: Events, ckpt: unbroken.Checkpointer, state: dict[str, Any]
) -> int | None:
    """Restore the newest state wherever the Checkpointer finds it (after evicting the
    checkpoint's pages with --cold); log where every rank's state came from."""
    evict_s, resident = 0.0, None
    if args.cold:
        from save_load import evict

        # Before any rank reads: every rank drops the checkpoint's pages from the page
        # cache (they are clean: saves end with fsync), as if the files were on a machine
        # that never had them cached; the barrier keeps one rank's reads from starting
        # before another rank's eviction.
        started = time.perf_counter()
        resident = evict(args.ckpt) if os.path.isdir(args.ckpt) else 0.0
        evict_s = time.perf_counter() - started
    dist.barrier()
    log("restore_start")
    held = state["progress"].step  # a healthy rank's live step (0 in a new process)
    restored = ckpt.restore(state)
    how = ckpt.last_restore
    source = None if how is None else source_of(how)
    # Whether this rank kept its own live state (healed at the step it held: none lost).
    mine = None if how is None else how.origins[dist.get_rank()]
    own = mine is not None and mine.kind == "live" and mine.peer is None
    log("restore_end", restored=restored, source=source, own=own, held=held,
        evict_s=evict_s, resident=resident)  # fmt: skip
    return restored


def source_of(restored: unbroken.Restored) -> str:
    """ "disk", or "shared memory" when the step came from the memory tiers (every rank's
    own node or a peer's replica), naming the ranks that got theirs from a peer."""
    kinds = [origin.kind for origin in restored.origins]
    if all(kind == "storage" for kind in kinds):
        return "disk"
    if "live" in kinds:
        return "live replicas" + "".join(
            f", {k} for ranks {[r for r, x in enumerate(kinds) if x == k]}"
            for k in sorted(set(kinds) - {"live"})
        )
    peers = [rank for rank, kind in enumerate(kinds) if kind == "replica"]
    return "shared memory" + (f", peer replicas for ranks {peers}" if peers else "")


def loop(
    args: argparse.Namespace,
    log: Events,
    ckpt: unbroken.Checkpointer,
    state: dict[str, Any],
    net: Parallel,
    restored: int | None,
    feed: Iterator[tuple[Tensor, Tensor]],
) -> torch.Tensor:
    """Train up to --steps: a snapshot every --memory-every steps, a disk save every
    --save-every, the steady-state figures logged at each disk save; return the last loss."""
    optim, progress = state["optim"], state["progress"]
    memory = args.memory_every > 0
    step_s: list[float] = []  # since the last disk save
    snapshot_s: list[float] = []
    loss = torch.tensor(float("nan"))
    while progress.step < args.steps:
        step = progress.step + 1
        started = time.perf_counter()
        x, y = next(feed)
        loss = (net(x, step) - y).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        loss = loss.detach()
        progress.step = step
        step_s.append(time.perf_counter() - started)
        if restored is not None:
            log("step_done", step=step)  # a restarted process: when it is back where it was
        elif len(step_s) == 1:
            log("loss", step=step, loss=loss.item())
        if args.live:  # the per-step record a replacement heals from, then the heartbeat
            ckpt.step(step, state)
        else:
            run.tick(step)  # heartbeat, and the injected fault, after the step completes
        if step == args.stop_step and restored is None and log.rank == args.stop_rank:
            stop_node(log, step)  # where a kill-node fault would fire
        if memory and step % args.memory_every == 0:
            started = time.perf_counter()
            ckpt.snapshot(step, state)
            snapshot_s.append(time.perf_counter() - started)
        if step % args.save_every == 0:
            started = time.perf_counter()
            ckpt.save(step, state)
            log(
                "stats",
                step=step,
                step_s=statistics.median(step_s),
                snapshot_s=statistics.median(snapshot_s) if snapshot_s else None,
                save_s=time.perf_counter() - started,
            )
            step_s, snapshot_s = [], []
    return loss


def stop_node(log: Events, step: int) -> None:
    """SIGSTOP this rank's whole node: its agent (the parent), every process below it,
    this one last. No connection closes, as when a kernel hangs or a network is cut."""
    from unbroken.run.procs import descendants

    agent = os.getppid()
    log("node_stopped", step=step, agent=agent)
    for pid in [agent, *(p for p in descendants(agent) if p != os.getpid())]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the event logs")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (on disk)")
    p.add_argument("--steps", type=int, default=85)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--memory-every", type=int, default=0, help="0: no shared memory")
    p.add_argument("--replicas", type=int, default=0)
    p.add_argument("--mib-per-rank", type=float, default=256)
    p.add_argument("--cold", action="store_true", help="evict the checkpoint before restore")
    p.add_argument(
        "--live", action="store_true", help="call Checkpointer.step every step (live healing)"
    )
    p.add_argument("--stop-rank", type=int, default=-1, help="this rank SIGSTOPs its node...")
    p.add_argument("--stop-step", type=int, default=-1, help="...after this step")
    args = p.parse_args()
    torch.set_num_threads(1)
    log = Events(args.out)
    # Built without values (as large models are), then given memory: a restore fills
    # it or, on a fresh start, train() initialises it.
    with torch.device("meta"):
        model = Model(width_for(args.mib_per_rank))
    model.to_empty(device="cpu")
    state = {
        "model": model,
        "optim": torch.optim.AdamW(model.parameters(), lr=1e-4),
        "progress": unbroken.Progress(step=0),
    }
    # Under `unbroken run --in-process`, train() runs again in this process after a peer
    # fails; otherwise this is init_process_group, then train() once.
    run.in_process(lambda: train(args, log, state), timeout_s=120)


if __name__ == "__main__":
    main()
