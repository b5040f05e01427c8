"""One process, no launcher: checkpoint every few steps; run it again and it continues
from the newest checkpoint.

    python examples/single_process.py --dir runs/single --steps 60
    python examples/single_process.py --dir runs/single --steps 100  # resumes at step 60
    unbroken ls runs/single
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import unbroken


def main() -> None:
    parser = argparse.ArgumentParser(description="train one process, resume on rerun")
    parser.add_argument("--dir", default="runs/single", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=100, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    progress = unbroken.Progress(step=0, epoch=0)  # the loop's own counters, checkpointed too
    state = {
        "model": model,  # nn.Module (DDP, FSDP2 and DTensor included)
        "optim": optimizer,  # anything with state_dict / load_state_dict
        "sched": scheduler,
        "rng": unbroken.RNGState(),  # python, numpy, torch CPU and CUDA streams, per rank
        "progress": progress,
        "config": {"lr": 1e-3},  # plain JSON values
    }

    with unbroken.Checkpointer(args.dir, keep=3) as ckpt:  # `with`: waits for saves at the end
        step = ckpt.restore(state) or 0  # newest committed checkpoint, loaded in place
        print(f"resumed from step {step}" if step else "starting at step 0", flush=True)
        while step < args.steps:
            x = torch.randn(32, 16)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step = progress.step = progress.step + 1
            if step % args.save_every == 0:
                ckpt.save(step, state)  # returns once the checkpoint is committed
                print(f"step {step}: loss {loss.item():.4f}, saved", flush=True)


if __name__ == "__main__":
    main()
