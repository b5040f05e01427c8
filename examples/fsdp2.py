"""FSDP2 (``fully_shard``) on CPU with gloo: each rank saves only its own shards, with
their offsets in the whole tensor, and restores straight into them. Run it again and it
continues from the newest checkpoint, on the same number of ranks or another.

    unbroken run --nproc-per-node 2 examples/fsdp2.py --dir runs/fsdp2 --steps 20
    torchrun --nproc-per-node 2 examples/fsdp2.py --dir runs/fsdp2 --steps 40  # resumes
    torchrun --nproc-per-node 3 examples/fsdp2.py --dir runs/fsdp2 --steps 60  # reshards
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken
import unbroken.run


def main() -> None:
    parser = argparse.ArgumentParser(description="FSDP2 on CPU, sharded checkpoints")
    parser.add_argument("--dir", default="runs/fsdp2", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=100, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()

    unbroken.run.init_process_group("gloo")  # works under torchrun too
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # parameters are now DTensors, sharded over the ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = unbroken.Progress(step=0)
    # Each rank's random streams differ: on another number of ranks, keep this run's.
    rng = unbroken.PerRank(unbroken.RNGState(), on_reshard="keep")
    state = {"model": model, "optim": optimizer, "rng": rng, "progress": progress}
    torch.manual_seed(rank)  # different data on each rank

    with unbroken.Checkpointer(args.dir, keep=2) as ckpt:
        step = ckpt.restore(state) or 0  # each rank reads only its own shards
        print(f"rank {rank}: resumed from step {step}" if step else f"rank {rank}: step 0")
        while step < args.steps:
            x = torch.randn(32, 16)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step = progress.step = progress.step + 1
            if step % args.save_every == 0:
                ckpt.save(step, state)  # collective: every rank, the same step
                if rank == 0:
                    print(f"step {step}: loss {loss.item():.4f}, saved")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
