"""The training job that tests/test_launcher.py and tests/test_inprocess.py run under
`unbroken run`: DDP on 2 gloo ranks (CPU), deterministic, its data a function of the step,
so that a run with faults must end bitwise equal to one without.

    python train_job.py --ckpt DIR --out DIR --steps N --save-every K [--replicas R]
                        [--in-process] [--heal]

Each start (each attempt, or each generation with ``--in-process``) appends one JSON
line to ``OUT/starts.jsonl``: the rank, its pid, the attempt or generation it was started
for and the one it runs in, its node, the step restored and where every rank's state
came from (``origins``, kinds by rank, from `Checkpointer.last_restore`). At the end each
rank writes its parameters' bytes to ``OUT/final-<rank>.bin``.

Without ``--in-process`` the job joins a process group once (`unbroken.run.init_process_group`);
with it, `unbroken.run.in_process` runs ``train`` again after a peer fails. With
``--heal`` the model, optimizer and progress live as long as the process (only the DDP
wrapper and the Checkpointer are built per generation), the job restores before it wraps
the model (DDP's construction broadcasts rank 0's parameters) and calls
``ckpt.step(step, state)`` each step, so healthy ranks keep their live state and a
replacement heals from them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unbroken
import unbroken.run
from unbroken.run import contract, worker


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--replicas", type=int, default=0)
    p.add_argument("--in-process", action="store_true", help="train under in_process")
    p.add_argument("--heal", action="store_true", help="ckpt.step each step: live healing")
    p.add_argument("--parts", action="store_true", help="--heal: a DDP wrapper per layer")
    p.add_argument("--split-barrier", type=int, default=0, help="--heal: see `split_barrier`")
    p.add_argument("--setup-s", type=float, default=0.0, help="a setup this long, before step 1")
    return p.parse_args()


_kept: dict[str, object] = {}  # --heal: what outlives a generation in this process


def train(args: argparse.Namespace) -> None:
    if args.heal:
        heal_train(args)
    else:
        plain_train(args)


def checkpointer(args: argparse.Namespace) -> unbroken.Checkpointer:
    memory_dir = os.environ.get(contract.MEMORY_DIR_ENV, contract.DEFAULT_MEMORY_ROOT)
    return unbroken.Checkpointer(
        args.ckpt,
        memory=True,
        memory_dir=memory_dir,
        replicas=args.replicas,
        timeout=60.0 if args.in_process else 600.0,  # 600: the default
    )


def heal_train(args: argparse.Namespace) -> None:
    """One generation with live healing: restore (heal), wrap, train, ``step`` each step."""
    rank = dist.get_rank()
    if not _kept:
        torch.manual_seed(0)
        built = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        adam = torch.optim.Adam(built.parameters(), lr=1e-2)
        _kept.update(module=built, optim=adam, progress=unbroken.Progress(step=0))
    module, optim, progress = _kept["module"], _kept["optim"], _kept["progress"]
    assert isinstance(module, nn.Module) and isinstance(optim, torch.optim.Optimizer)
    assert isinstance(progress, unbroken.Progress)
    state = {"model": module, "optim": optim, "progress": progress}
    if args.split_barrier and rank == 1 and "split" not in _kept:
        split_barrier(args.split_barrier, progress)
    ckpt = checkpointer(args)
    restored = ckpt.restore(state)
    record_start(args.out, rank, restored, ckpt.last_restore)
    model: nn.Module
    if args.parts:  # each layer its own wrapper: layouts kept by the part's path
        model = nn.Sequential(
            *(DistributedDataParallel(m) if list(m.parameters()) else m for m in module.children())
        )
    else:
        model = DistributedDataParallel(module)
    while progress.step < args.steps:
        step = progress.step + 1
        one_step(model, optim, step, rank)
        progress.step = step
        ckpt.step(step, state)
        end_step(ckpt, step, state, args)
    finish(ckpt, module, args.out, rank)


def split_barrier(step: int, progress: unbroken.Progress) -> None:
    """A peer dying in the barrier of ``step`` (`unbroken.healing.inflight`) can leave
    the survivors split: gloo's barrier completes on some and fails on others. This rank
    is made one of the others, once: its barrier of ``step`` completes on every rank,
    then fails here, as gloo's does, so the others apply the step and this one does not."""
    barrier, armed = dist.barrier, [True]
    _kept["split"] = armed

    def failing(*args: Any, **kwargs: Any) -> None:
        barrier(*args, **kwargs)
        if progress.step + 1 == step and armed and armed.pop():
            raise RuntimeError(f"Connection closed by peer (the barrier of step {step})")

    dist.barrier = failing


def one_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # the data depends on the step
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = (model(x) - y).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def end_step(ckpt: unbroken.Checkpointer, step: int, state: dict, args: argparse.Namespace) -> None:
    time.sleep(0.02)  # a step long enough for faults to land mid-run
    unbroken.run.tick(step)
    ckpt.snapshot(step, state)
    if step % args.save_every == 0:
        ckpt.save(step, state)


def finish(ckpt: unbroken.Checkpointer, model: nn.Module, out: str, rank: int) -> None:
    ckpt.close()
    with open(os.path.join(out, f"final-{rank}.bin"), "wb") as f:
        for t in model.state_dict().values():
            f.write(t.numpy().tobytes())


def plain_train(args: argparse.Namespace) -> None:
    """One attempt (or generation): build, restore, train to the end, write the result."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    progress = unbroken.Progress(step=0)
    state = {"model": model, "optim": optim, "progress": progress}
    ckpt = checkpointer(args)
    restored = ckpt.restore(state)
    record_start(args.out, rank, restored, ckpt.last_restore)
    while progress.step < args.steps:
        step = progress.step + 1
        one_step(model, optim, step, rank)
        progress.step = step
        end_step(ckpt, step, state, args)
    finish(ckpt, model, args.out, rank)


def record_start(out: str, rank: int, restored: int | None, how: unbroken.Restored | None) -> None:
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),  # started for
        "seen_generation": worker.current().attempt,  # runs in (in-process: may be later)
        "node": os.environ.get(contract.NODE_ENV),
        "restored": restored,
        "origins": None if how is None else [o.kind for o in how.origins],
    }
    with open(os.path.join(out, "starts.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    time.sleep(args.setup_s)  # building a large model, say: no step, so no beat
    if args.in_process:
        unbroken.run.in_process(lambda: train(args), timeout_s=30)
        return
    unbroken.run.init_process_group("gloo", timeout_s=60)
    train(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
