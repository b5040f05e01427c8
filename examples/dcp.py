"""torch.distributed.checkpoint (DCP) saving into unbroken's format: DCP's own ``save``,
``load`` and planners; unbroken's storage (local or S3), checksums and atomic commit.
Run it again and it continues from the newest step. The same calls work on every rank
of a distributed job (FSDP2 and DTensor state included), and a checkpoint saved on N
ranks loads on M: DCP's planner reshards it.

    python examples/dcp.py --dir runs/dcp --steps 20
    python examples/dcp.py --dir runs/dcp --steps 40   # resumes from step 20
    unbroken verify runs/dcp --all                       # every checksum, every step
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import unbroken.dcp

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process


def main() -> None:
    parser = argparse.ArgumentParser(description="DCP save/load into unbroken's format")
    parser.add_argument("--dir", default="runs/dcp", help="checkpoint directory or s3:// URL")
    parser.add_argument("--steps", type=int, default=100, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    step = unbroken.dcp.latest(args.dir) or 0  # the newest committed step, if any
    if step:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        reader = unbroken.dcp.Reader(args.dir, step=step)  # every block checksummed
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=reader)  # in place
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    print(f"resumed from step {step}" if step else "starting at step 0", flush=True)

    while step < args.steps:
        x = torch.randn(32, 16)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.save_every == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            writer = unbroken.dcp.Writer(args.dir, step=step)  # committed once all is durable
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
            print(f"step {step}: loss {loss.item():.4f}, saved", flush=True)


if __name__ == "__main__":
    main()
