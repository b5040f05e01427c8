"""One rank of bench/storm.py's job under torchrun or ``unbroken run``, for methods
(a) DCP (``--method dcp``: ``async_save`` to local disk every --save-every steps, restart
from the newest committed one), (b) and (c) unbroken (``--method unbroken``: memory
snapshots every --memory-every steps with a replica on the other node, background saves
every --save-every; ``--live``: ``Checkpointer.step`` every step, for in-process healing)
and (e) the reference (``--method plain``: no checkpoint, no fault)."""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import unbroken
from storm_job import Events, batches, build_model, digest, loss_of, optimizer, sampler


def train(args: argparse.Namespace, state: dict[str, Any], log: Events, ckpt: Any) -> None:
    """The loop from the restored step to --steps; ``ckpt`` saves (None: no saves)."""
    model = state["model"]
    net = DistributedDataParallel(model, broadcast_buffers=False, init_sync=False)
    feed = batches(state["dataset"], state["data"])
    progress = state["progress"]
    while progress.step < args.steps:
        step = progress.step + 1
        loss = loss_of(net, next(feed))
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        progress.step = step
        started = time.perf_counter()
        if ckpt is not None:
            ckpt.after(step)
        log("step", step=step, loss=loss.item(), ckpt_s=time.perf_counter() - started)
    if ckpt is not None:
        ckpt.close()
    log("final", step=progress.step, digest=digest(model))
    if args.calibrate:  # what one async_save blocks the loop for: (a)'s Young/Daly interval
        dcp = Dcp(args, state)
        started = time.perf_counter()
        dcp.after(args.save_every)
        log("calibrate", dcp_stall_s=time.perf_counter() - started)
        dcp.close()


class Dcp:
    """torch.distributed.checkpoint as its docs run it: ``async_save`` on a gloo group of
    its own, the previous save awaited before the next starts; a step directory counts
    once its ``.metadata`` is written (DCP's commit)."""

    def __init__(self, args: argparse.Namespace, state: dict[str, Any]) -> None:
        self.args, self.state = args, state
        self.group = dist.new_group(backend="gloo")
        self.pending: Any = None

    def values(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.state["model"], self.state["optim"])
        step = self.state["progress"].step
        return {"model": model, "optim": optim, "data": self.state["data"].state_dict(),
                "step": step}  # fmt: skip

    def restore(self) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        os.makedirs(self.args.ckpt, exist_ok=True)
        done = [int(d) for d in os.listdir(self.args.ckpt)
                if os.path.exists(os.path.join(self.args.ckpt, d, ".metadata"))]  # fmt: skip
        if not done:
            return 0
        values = self.values()
        dcp.load(values, checkpoint_id=os.path.join(self.args.ckpt, str(max(done))))
        set_state_dict(
            self.state["model"], self.state["optim"],
            model_state_dict=values["model"], optim_state_dict=values["optim"],
        )  # fmt: skip
        self.state["data"].load_state_dict(values["data"])
        self.state["progress"].step = int(values["step"])
        return int(values["step"])

    def after(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if step % self.args.save_every:
            return
        if self.pending is not None:
            self.pending.result()
        where = os.path.join(self.args.ckpt, str(step))
        self.pending = dcp.async_save(self.values(), checkpoint_id=where, process_group=self.group)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()


class Unbroken:
    """unbroken's Checkpointer: the per-step record (--live), snapshots, background saves."""

    def __init__(self, args: argparse.Namespace, state: dict[str, Any]) -> None:
        self.args, self.state = args, state
        self.ckpt = unbroken.Checkpointer(args.ckpt, memory=True, replicas=1, keep=2, timeout=60)
        self.saved = {k: state[k] for k in ("model", "optim", "data", "progress")}

    def restore(self) -> int:
        return self.ckpt.restore(self.saved) or 0

    def after(self, step: int) -> None:
        from unbroken import run

        if self.args.live:
            self.ckpt.step(step, self.saved)
        else:
            run.tick(step)
        if step % self.args.memory_every == 0:
            self.ckpt.snapshot(step, self.saved)
        if step % self.args.save_every == 0:
            self.ckpt.save(step, self.saved, blocking=False)

    def close(self) -> None:
        self.ckpt.close()


def generation(args: argparse.Namespace, state: dict[str, Any], log: Events) -> None:
    """One generation on the default group: restore, then train."""
    state["dataset"], state["data"] = sampler(args.out, dist.get_rank(), dist.get_world_size())
    state["progress"].step = 0
    ckpt: Dcp | Unbroken | None = None
    if args.method != "plain":
        ckpt = (Dcp if args.method == "dcp" else Unbroken)(args, state)
    restored = ckpt.restore() if ckpt is not None else 0
    if restored == 0:  # a fresh start: every rank from the same initial values
        state["model"].load_state_dict(state["initial"])
    log("restored", step=restored)
    train(args, state, log, ckpt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=("dcp", "unbroken", "plain"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--memory-every", type=int, default=5)
    p.add_argument("--live", action="store_true")
    p.add_argument("--calibrate", action="store_true", help="time one DCP async_save at the end")
    p.add_argument("--timeout", type=float, default=30.0, help="the collectives' (DCP, plain)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    progress = unbroken.Progress(step=0)
    state = {"model": model, "optim": optimizer(model), "progress": progress, "initial": initial}
    log = Events(args.out, int(os.environ["RANK"]))
    if args.method == "unbroken":
        from unbroken import run

        # Under --in-process a healthy rank runs generation() again after a peer fails.
        run.in_process(lambda: generation(args, state, log), timeout_s=60)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    generation(args, state, log)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
