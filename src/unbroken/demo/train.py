"""One rank of the demo's training job. Launched by torchrun, never directly::

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m unbroken.demo.train --dir CKPT_DIR --data TOKENS --steps 60 --save-every 10

It restores the newest committed checkpoint in ``--dir`` (if any), trains to ``--steps``
and saves every ``--save-every`` steps. The data is the token file ``--data``, memory-mapped
(`unbroken.data.TokenDataset`), read by DataLoader workers in the order of a
`unbroken.data.ResumableSampler`; its position is part of every checkpoint. Rank 0
reports progress as ``@demo {json}`` lines on stdout, which `unbroken.demo.run` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import unbroken
from unbroken.data import ByteTokenizer, ResumableLoader, ResumableSampler, TokenDataset
from unbroken.demo import EVENT_PREFIX
from unbroken.demo.model import GPTConfig, TinyGPT
from unbroken.run import tick
from unbroken.run.contract import EVENTS_DIR_ENV


def emit(event: str, **fields: Any) -> None:
    # json.dumps writes floats with repr(), which round-trips exactly: the parent process
    # compares the very bits the training loop produced.
    # One write call per line, so output from the other rank cannot land mid-line.
    sys.stdout.write(f"{EVENT_PREFIX}{json.dumps({'event': event, **fields})}\n")
    sys.stdout.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="unbroken.demo.train")
    p.add_argument("--dir", required=True, help="checkpoint directory")
    p.add_argument("--data", required=True, help="token file (unbroken tokenise)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The goodput event log (`unbroken goodput DIR/events/<run>`), next to the checkpoints.
    os.environ.setdefault(
        EVENTS_DIR_ENV, os.path.join(args.dir, os.pardir, "events", os.path.basename(args.dir))
    )
    # One thread per rank: the demo runs two ranks on two cores, and a fixed thread count
    # also fixes the order of floating-point reductions inside each op.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        train(args)
    finally:
        dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=ByteTokenizer.vocab_size)

    # Same seed everywhere for the initial weights; a per-rank seed afterwards so the
    # ranks draw different dropout masks (RNGState saves each rank's own streams).
    _seed_all(args.seed)
    model = DistributedDataParallel(TinyGPT(cfg))
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        optim, T_max=args.steps, eta_min=args.lr / 10
    )
    data = _loader(args, cfg.block_size)
    _seed_all(args.seed + 1 + rank)
    progress = unbroken.Progress(step=0)
    state: dict[str, Any] = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "data": data,
        "rng": unbroken.RNGState(),
        "progress": progress,
    }

    ckpt = unbroken.Checkpointer(args.dir)
    try:
        restored = ckpt.restore(state)
        if restored is not None and progress.step != restored:
            raise RuntimeError(f"restored step {restored} but progress says {progress.step}")
        if rank == 0:
            emit("start", restored=restored, world=world)
        model.train()
        batches = _forever(data)  # made after the restore: it starts at the saved position
        while progress.step < args.steps:
            tokens = next(batches)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            loss = model(inputs, targets)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            progress.step += 1
            tick(progress.step)  # before rank 0 reports it: a kill then finds it reached
            # The reported loss is the mean over ranks (a sum of two floats: deterministic).
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                emit("step", step=progress.step, loss=(mean / world).item())
            if progress.step % args.save_every == 0:
                ckpt.save(progress.step, state)
    finally:
        ckpt.close()
    if rank == 0:
        emit("done", step=progress.step)


def _loader(args: argparse.Namespace, block_size: int) -> ResumableLoader:
    """This rank's batches: windows of the memory-mapped token file, in an order that is
    shuffled per epoch from the seed and split between the ranks. The loader's state
    counts the batches the loop received, not those its workers fetched ahead."""
    dataset = TokenDataset([args.data], seq_len=block_size)
    sampler = ResumableSampler(dataset, args.batch_size, seed=args.seed)
    # A generator of its own: otherwise each new DataLoader iterator (each epoch, and
    # after a restore) draws its workers' seed from torch's global RNG, whose stream the
    # dropout masks of a resumed run must share with the uninterrupted run.
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        generator=torch.Generator().manual_seed(args.seed),
    )
    return ResumableLoader(loader)


def _forever(loader: ResumableLoader) -> Iterator[torch.Tensor]:
    while True:  # one pass of the loader is the rest of an epoch
        yield from loader


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


if __name__ == "__main__":
    sys.exit(main())
