"""In-process recovery: when a rank dies, the healthy ranks keep their processes, model
and optimizer, only the dead rank is started again, and ``train()`` runs again in every
process. ``ckpt.step`` each step lets ``restore`` heal from live replicas: healthy ranks
keep their current state and the replacement receives it from them, so at most the step
in flight is lost. Where that cannot work, restore falls back to the newest snapshot in
shared memory or in a peer's replica.

    unbroken run --in-process --simulate-nodes 2 --nproc-per-node 1 --max-restarts 1 \\
        --inject-fault "kill rank=1 step=30" examples/in_process.py --dir runs/inproc
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unbroken
import unbroken.run

parser = argparse.ArgumentParser(description="DDP with in-process recovery")
parser.add_argument("--dir", default="runs/inproc", help="checkpoint directory")
parser.add_argument("--steps", type=int, default=60, help="train up to this step")
parser.add_argument("--save-every", type=int, default=20)
parser.add_argument("--snapshot-every", type=int, default=5)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
progress = unbroken.Progress(step=0)
# Built once per process: kept by healthy ranks across a failure.
state = {"model": model, "optim": optimizer, "rng": unbroken.RNGState(), "progress": progress}


def train() -> None:
    """One generation: what holds a process group is built here."""
    rank = dist.get_rank()
    ckpt = unbroken.Checkpointer(args.dir, memory=True, replicas=1, timeout=60)
    step = ckpt.restore(state) or 0  # live replicas, shared memory, a peer's replica, storage
    if ckpt.last_restore is not None:
        print(f"rank {rank}: resumed from step {step} ({ckpt.last_restore.origin.kind})")
    else:
        torch.manual_seed(rank)  # different data on each rank; RNGState keeps it after
    ddp = DistributedDataParallel(model)  # after restore: DDP broadcasts rank 0's weights
    while step < args.steps:
        x = torch.randn(32, 16)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step = progress.step = progress.step + 1
        ckpt.step(step, state)  # every step: what replicas do not share, kept by a peer
        if step % args.snapshot_every == 0:
            ckpt.snapshot(step, state)  # into shared memory, sent on to a peer
        if step % args.save_every == 0:
            ckpt.save(step, state)
    ckpt.close()
    print(f"rank {rank}: finished at step {step}")


unbroken.run.in_process(train)  # initialises the process group; reruns train() after a fault
