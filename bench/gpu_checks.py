"""The sections of bench/gpu.py that check unbroken alone on the device: a restore from
memory into device tensors, and what the overlapped capture must refuse or survive on
CUDA (run after the overlap section's timings, in its process).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import unbroken
from gpu_sections import Ctx, Section, differ, ms, plain, rate, stepped, sync, train_step, values
from unbroken.errors import CheckpointError

SNAPSHOTS = 4  # taken by the memory section


# --------------------------------------------------------------------------- memory


def memory_root(ctx: Ctx, nbytes: int) -> str:
    """A fresh folder for the memory tier: in /dev/shm where it has room for the
    snapshot slots (a container's is often 64 MiB), else on disk under the work dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 4 * nbytes:
        return tempfile.mkdtemp(prefix="unbroken-gpu-", dir=shm)
    return str(ctx.work / "shm")


def memory(ctx: Ctx) -> Section:
    """Snapshots of the device state into shared memory (device copies, the deferred
    ones beside the next step), then, the live state moved on, a restore from memory
    into the device tensors."""
    out = Section()
    model, optim = stepped(ctx, seed=0)
    nbytes = sum(t.nbytes for t in values(model, optim))
    root = memory_root(ctx, nbytes)
    ckpt = unbroken.Checkpointer(ctx.work / "ckpt", memory=True, memory_dir=root, job="gpu")
    state = {"model": model, "optim": optim}
    taken, want = [], values(model, optim)
    try:
        for n in range(1, SNAPSHOTS + 1):
            train_step(model, optim, ctx.batch, plain)
            sync(ctx)
            want = values(model, optim)
            sync(ctx)
            start = time.perf_counter()
            ckpt.snapshot(n, state)
            sync(ctx)
            taken.append(time.perf_counter() - start)
        ckpt.wait()  # published: checksummed and sealed
        for _ in range(2):  # the live state moves past the snapshot
            train_step(model, optim, ctx.batch, plain)
        sync(ctx)
        start = time.perf_counter()
        step = ckpt.restore(state)
        sync(ctx)
        restore_s = time.perf_counter() - start
        origin = ckpt.last_restore.origin.kind if ckpt.last_restore else None
        wrong = differ(values(model, optim), want)
        ckpt.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    snap = statistics.median(taken)
    where = "/dev/shm" if root.startswith("/dev/shm") else "a disk folder (/dev/shm too small)"
    out.rows.append(
        (f"snapshot of device tensors into {where}", f"{ms(snap)} ({rate(nbytes, snap)})", "-")
    )
    ok = step == SNAPSHOTS and origin == "memory" and not wrong
    detail = f"step {step} from {origin}, {wrong} tensor(s) differ"
    out.rows.append(
        (
            "restore from memory into device tensors",
            f"{ms(restore_s)} ({rate(nbytes, restore_s)})",
            out.check("restore from memory", ok, detail, f"bitwise, step {step}"),
        )
    )
    out.result = {
        "nbytes": nbytes,
        "snapshot_ms": round(snap * 1e3, 2),
        "restore_ms": round(restore_s * 1e3, 2),
        "origin": origin,
        "wrong": wrong,
    }
    return out


# --------------------------------------------------------------------------- overlap


def torn_refused(ctx: Ctx) -> tuple[bool, str]:
    """A parameter changed outside ``optimizer.step()`` while its overlapped copy runs
    (on CUDA: queued while the side stream still copies it): the save must fail naming
    it, and the step before must stay committed and whole."""
    model, optim = stepped(ctx, seed=0)
    state = {"model": model, "optim": optim}
    with unbroken.Checkpointer(ctx.work / "torn", keep=None) as ckpt:
        ckpt.save(1, state)
        first = values(model, optim)
        train_step(model, optim, ctx.batch, plain)
        handle = ckpt.save(2, state, blocking=False)
        with torch.no_grad():
            dict(model.named_parameters())["0.0.weight"].add_(1.0)  # not by the optimizer
        try:
            handle.wait()
            return False, "the torn save of step 2 committed"
        except CheckpointError as e:
            if "0.0.weight" not in str(e):
                return False, f"refused without naming the tensor: {e}"
        steps = ckpt.steps()
    fresh, fresh_optim = stepped(ctx, seed=99)
    with unbroken.Checkpointer(ctx.work / "torn") as again:
        again.restore({"model": fresh, "optim": fresh_optim})
    wrong = differ(values(fresh, fresh_optim), first)
    return steps == [1] and not wrong, f"steps {steps}, {wrong} tensor(s) of step 1 differ"


def optimizer_first(ctx: Ctx) -> tuple[bool, str]:
    """An overlapped save of a state that names the optimizer before the model: its first
    deferred tensor is then a CPU one (AdamW's ``step``), the others on the device. The
    next optimizer step must run, and the save must hold the values at the save."""
    model, optim = stepped(ctx, seed=0)
    state = {"optim": optim, "model": model}
    ckpt = unbroken.Checkpointer(ctx.work / "optim-first", keep=None)
    sync(ctx)
    want = values(model, optim)
    handle = ckpt.save(1, state, blocking=False)
    try:
        train_step(model, optim, ctx.batch, plain)  # its pre-hook settles the copy
    except Exception as e:  # the save may now wait forever: left behind (see gpu.py)
        return False, f"the next optimizer step raised {type(e).__name__}: {e}"[:240]
    handle.wait()
    ckpt.close()
    fresh, fresh_optim = stepped(ctx, seed=99)
    with unbroken.Checkpointer(ctx.work / "optim-first") as again:
        again.restore({"optim": fresh_optim, "model": fresh})
    wrong = differ(values(fresh, fresh_optim), want)
    return not wrong, f"{wrong} tensor(s) differ"


def overlap_checks(ctx: Ctx, out: Section) -> Section:
    """``out`` (the overlap section's timings) with the two checks above."""
    ok, detail = torn_refused(ctx)
    what = "change outside optimizer.step() during the copy"
    out.rows.append((what, "save refused", out.check(what, ok, detail, "refused, step 1 kept")))
    ok2, detail = optimizer_first(ctx)
    what = "overlapped save, optimizer named before the model"
    out.rows.append((what, "next step ran", out.check(what, ok2, detail)))
    out.result |= {"torn_refused": ok, "optimizer_first": ok2}
    return out
