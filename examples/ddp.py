"""DDP on CPU under ``unbroken run``: a snapshot in shared memory every step, replicated
to a peer rank, and a save to storage every few steps. Kill a rank and the restarted
workers resume from memory, at most one step back, not from the last save.

    unbroken run --nproc-per-node 2 --max-restarts 1 --inject-fault "kill rank=1 step=25" \\
        examples/ddp.py --dir runs/ddp --steps 40 --save-every 10
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unbroken
import unbroken.run
from unbroken.errors import PeerLostError


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP with memory snapshots and replicas")
    parser.add_argument("--dir", default="runs/ddp", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=100, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()

    unbroken.run.init_process_group("gloo")  # a store per restart attempt
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = unbroken.Progress(step=0)
    state = {"model": model, "optim": optimizer, "rng": unbroken.RNGState(), "progress": progress}
    torch.manual_seed(rank)  # different data on each rank; RNGState keeps it per rank

    ckpt = unbroken.Checkpointer(args.dir, memory=True, replicas=1)
    step = ckpt.restore(state) or 0  # memory, if every rank holds the step, else storage
    if ckpt.last_restore is not None:
        print(f"rank {rank}: resumed from step {step} ({ckpt.last_restore.origin.kind})")
    while step < args.steps:
        x = torch.randn(32, 16)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step = progress.step = progress.step + 1
        ckpt.snapshot(step, state)  # every step: into this node's shared memory, no storage IO
        if step % args.save_every == 0:
            ckpt.save(step, state, blocking=False)  # less often: to storage, in the background
    ckpt.close()  # waits for the background saves
    print(f"rank {rank}: finished at step {step}")
    dist.destroy_process_group()


# How gloo says that the other end of a connection is gone: the training step's own
# collectives (DDP's all-reduce) raise its RuntimeError as it is, gloo's whole text.
GONE = ("connection closed", "connection reset", "broken pipe", "read error", "write error")


def _peer_lost(error: BaseException | None) -> str | None:
    """Where ``error``, or what caused it, says another rank died: the checkpointer's
    group lost a peer (`PeerLostError`), or a collective of the training step found its
    connection gone; None if nothing in it does (a bug: its traceback is wanted)."""
    while error is not None:
        if isinstance(error, PeerLostError):
            return "checkpointing"
        if isinstance(error, RuntimeError) and any(w in str(error).lower() for w in GONE):
            return "a training collective"
        error = error.__cause__ or error.__context__
    return None


if __name__ == "__main__":
    try:
        main()
    except (unbroken.CheckpointError, RuntimeError) as e:
        where = _peer_lost(e)
        if where is None:
            raise
        # Another rank died: this attempt is over, as expected. One line, not a traceback.
        rank = os.environ.get("RANK", "?")
        print(f"rank {rank}: lost a peer in {where}; exiting for `unbroken run` to restart all")
        raise SystemExit(1) from None
