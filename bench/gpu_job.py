"""The recovery section of bench/gpu.py, and the training job it runs under
``unbroken run --in-process``: a rank killed by the product's fault injection is
replaced in process, healed from its live replica, and the run ends with parameters
bitwise equal to an uninterrupted one; the survivor's NCCL groups are aborted.

    python -m unbroken.run --in-process --simulate-nodes=2 --nproc-per-node=1 \\
        --max-restarts=1 [--inject-fault="kill rank=1 step=8"] \\
        bench/gpu_job.py --out DIR --ckpt DIR --mode MODE

Two ranks (two simulated nodes of one rank: each its own shared memory), both on
cuda:0. ``--mode`` says what torch allowed on one GPU (`probe`):

- ``nccl``: both ranks in one NCCL group (DDP over it). A rank killed while its peer's
  all-reduce is queued leaves that peer stuck on the GPU: only the abort frees it.
- ``solo``: NCCL refused two ranks on one device. DDP runs over the in-process gloo
  group with CUDA tensors (gloo's CUDA path), and each rank all-reduces every step on
  a one-rank NCCL group of its own; the survivor's group must be aborted: a collective
  on it fails in the next generation.
- ``gloo``: ``--cpu-dry-run``: CPU tensors, no NCCL.

Each start of each rank appends a JSON line to ``OUT/starts.jsonl`` (pid, generation,
step restored, where every rank's state came from, the NCCL check); at the end each
rank writes its parameters' bytes to ``OUT/final-<rank>.bin``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unbroken
import unbroken.run
from common import free_port
from gpu_sections import Ctx, Section
from unbroken.run import worker

STEPS, SAVE_EVERY, KILL_STEP = 16, 10, 8
FAULT = f"kill rank=1 step={KILL_STEP}"
JOB = Path(__file__).resolve()
PROBE_S = 40.0  # NCCL refuses two ranks on one device at once; a hang is a refusal too
RUN_S = 75.0  # one launch of the job; a recovery that hangs ends here

# What outlives a generation in this process: model, optimizer, progress, and the NCCL
# group of the generation before (the survivor checks that it was aborted).
_kept: dict[str, Any] = {}


# --------------------------------------------------------------------------- the job


def device(mode: str) -> torch.device:
    return torch.device("cpu" if mode == "gloo" else "cuda:0")


def built(mode: str) -> tuple[nn.Module, torch.optim.Optimizer, unbroken.Progress]:
    if not _kept:
        torch.manual_seed(0)
        dev = device(mode)
        module = nn.Sequential(
            nn.Linear(64, 256, device=dev),
            nn.Tanh(),
            nn.Linear(256, 256, device=dev),
            nn.Tanh(),
            nn.Linear(256, 8, device=dev),
        )
        optim = torch.optim.Adam(module.parameters(), lr=1e-2)
        _kept.update(module=module, optim=optim, progress=unbroken.Progress(step=0))
    return _kept["module"], _kept["optim"], _kept["progress"]


def old_group_fails(mode: str) -> bool | None:
    """On a rank that lived through a failure (``solo``): whether a collective on its
    one-rank NCCL group of the failed generation fails, as an aborted one must. None
    where there is nothing to check (``nccl``: a collective there would wait for the
    dead peer; the survivor getting past its stuck all-reduce is that mode's check)."""
    old = _kept.pop("group", None)
    if old is None or mode != "solo":
        return None
    try:
        t = torch.ones(1, device=device(mode))
        old.allreduce([t]).wait()
        torch.cuda.synchronize()
    except Exception:
        return True
    return False


def groups(mode: str) -> tuple[Any, Any]:
    """(DDP's group, the group all-reduced every step) of this generation."""
    if mode == "gloo":
        return None, None
    wait = timedelta(seconds=60)
    if mode == "nccl":
        group = dist.new_group(backend="nccl", timeout=wait)
        return group, group
    solo, _ = dist.new_subgroups(group_size=1, backend="nccl", timeout=wait)
    return None, solo


def train(args: argparse.Namespace) -> None:
    """One generation: restore (heal), groups, DDP, train, ``ckpt.step`` each step."""
    rank = dist.get_rank()
    module, optim, progress = built(args.mode)
    state = {"model": module, "optim": optim, "progress": progress}
    ckpt = unbroken.Checkpointer(args.ckpt, memory=True, replicas=1, timeout=60.0)
    restored = ckpt.restore(state)
    record_start(args, rank, restored, ckpt.last_restore, old_group_fails(args.mode))
    ddp_group, every_step = groups(args.mode)
    _kept["group"] = every_step
    cuda = args.mode != "gloo"
    model = DistributedDataParallel(
        module, device_ids=[0] if cuda else None, process_group=ddp_group
    )
    while progress.step < args.steps:
        step = progress.step + 1
        one_step(model, optim, step, rank, device(args.mode))
        if every_step is not None and ddp_group is None:
            dist.all_reduce(torch.ones(1, device=device(args.mode)), group=every_step)
        progress.step = step
        ckpt.step(step, state)  # the injected kill fires here (worker.tick)
        ckpt.snapshot(step, state)
        if step % args.save_every == 0:
            ckpt.save(step, state)
    ckpt.close()
    with open(os.path.join(args.out, f"final-{rank}.bin"), "wb") as f:
        for t in module.state_dict().values():
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def one_step(model: nn.Module, optim: Any, step: int, rank: int, dev: torch.device) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # the data depends on the step
    x, y = torch.randn(16, 64, generator=g).to(dev), torch.randn(16, 8, generator=g).to(dev)
    loss = (model(x) - y).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def record_start(
    args: argparse.Namespace,
    rank: int,
    restored: int | None,
    how: unbroken.Restored | None,
    old_fails: bool | None,
) -> None:
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "generation": worker.current().attempt,
        "restored": restored,
        "origins": None if how is None else [o.kind for o in how.origins],
        "old_nccl_group_fails": old_fails,
    }
    with open(os.path.join(args.out, "starts.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def job() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--mode", choices=("nccl", "solo", "gloo"), required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--save-every", type=int, default=SAVE_EVERY)
    args = p.parse_args()
    torch.set_num_threads(1)
    # Warned, not raised, for an op without a deterministic kernel: the bitwise
    # comparison with the reference run is the check.
    torch.use_deterministic_algorithms(True, warn_only=True)
    unbroken.run.in_process(lambda: train(args), timeout_s=60)


# --------------------------------------------------------------------------- the probe


def probe_rank(rank: int, port: int) -> None:
    """``--probe RANK PORT``: one of two ranks of an NCCL group on cuda:0."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=PROBE_S),
    )
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert t.item() == 2.0, t.item()
    dist.destroy_process_group()
    print("probe ok")


def probe(dry: bool) -> tuple[str, str]:
    """(mode, how it was chosen): whether two ranks may share one NCCL group on cuda:0."""
    if dry:
        return "gloo", "--cpu-dry-run: 2 CPU ranks, DDP over gloo, no NCCL"
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), "--probe", str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + PROBE_S
    outs = [finished(p, max(1.0, deadline - time.monotonic())) for p in procs]
    if all(rc == 0 and "probe ok" in out for rc, out, _ in outs):
        return "nccl", "2 ranks in one NCCL group on cuda:0 (DDP over NCCL)"
    lines = [ln for _, _, err in outs for ln in err.splitlines() if ln.strip()]
    why = next((ln for ln in lines if "uplicate GPU" in ln), lines[-1] if lines else "timed out")
    return "solo", (
        f"NCCL refused 2 ranks on one GPU ({why.strip()[:120]}): 2 CUDA ranks, DDP over "
        "gloo with CUDA tensors, each rank beside a one-rank NCCL group"
    )


def finished(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``proc`` and its session, killed past ``timeout_s``."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -9, out, err + f"\ntimed out after {timeout_s:.0f} s"


# --------------------------------------------------------------------------- the launches


def launch(where: Path, mode: str, fault: str | None, timeout_s: float) -> dict[str, Any]:
    """One run of the job under ``unbroken run --in-process``: its exit, seconds,
    timeline, final parameters and start records. The faulted run takes its ranks and
    the replacement from warm spares, forked from a template that imported torch without
    initialising CUDA (`unbroken.run.template`); the reference starts its ranks cold."""
    out = where / "out"
    out.mkdir(parents=True)
    timeline = where / "timeline.json"
    cmd = [
        sys.executable,
        "-m",
        "unbroken.run",
        "--in-process",
        "--simulate-nodes=2",
        "--nproc-per-node=1",
        "--max-restarts=1",
        f"--timeline-json={timeline}",
        *([f"--inject-fault={fault}", "--warm-spare"] if fault else []),
        str(JOB),
        f"--out={out}",
        f"--ckpt={where / 'ckpt'}",
        f"--mode={mode}",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "UNBROKEN_MEMORY_DIR": str(where / "shm"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # torch's advice for its abort
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # deterministic cuBLAS
    }
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    rc, _, err = finished(proc, timeout_s)
    run: dict[str, Any] = {"rc": rc, "seconds": time.monotonic() - start, "stderr": err}
    if rc == 0:
        finals = [out / f"final-{r}.bin" for r in range(2)]
        run["timeline"] = json.loads(timeline.read_text())
        run["params"] = [p.read_bytes() if p.exists() else None for p in finals]
        run["starts"] = [json.loads(ln) for ln in (out / "starts.jsonl").read_text().splitlines()]
    return run


def starts_of(run: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    return sorted((s for s in run["starts"] if s["rank"] == rank), key=lambda s: s["generation"])


def failed(run: dict[str, Any]) -> str:
    """Why a launch failed: its exit and the last lines of its error output."""
    tail = [ln for ln in run["stderr"].splitlines() if ln.strip()][-3:]
    return f"exit {run['rc']}: {' | '.join(tail)[-300:]}"


def healed(hit: dict[str, Any]) -> tuple[bool, str]:
    """The faulted run: one recovery replacing rank 1 from a warm spare; rank 0 kept its
    process; in the next generation both ranks restored step `KILL_STEP` from live
    replicas."""
    recs = hit["timeline"]["recoveries"]
    ranks = [starts_of(hit, r) for r in range(2)]
    kept = len(ranks[0]) == 2 and ranks[0][0]["pid"] == ranks[0][1]["pid"]
    replaced = len(ranks[1]) == 2 and ranks[1][0]["pid"] != ranks[1][1]["pid"]
    again = [r[-1] for r in ranks if r]
    live = len(again) == 2 and all(
        s["restored"] == KILL_STEP and s["origins"] == ["live", "live"] for s in again
    )
    spare = any(
        e["event"] == "respawn" and e.get("rank") == 1 and e.get("spare")
        for e in hit["timeline"]["events"]
    )
    ok = [r["respawned"] for r in recs] == [[1]] and kept and replaced and live and spare
    detail = (
        f"recoveries {[r['respawned'] for r in recs]}, rank 0 kept its process: {kept}, "
        f"rank 1 from a warm spare: {spare}, "
        f"restored {[(s['restored'], s['origins']) for s in again]}"
    )
    return ok, detail


def nccl_check(mode: str, hit: dict[str, Any], back: float) -> tuple[str, bool, str]:
    """(what was seen, ok, detail) of the survivor's NCCL abort, ``back`` seconds from
    the kill to training again."""
    if mode == "gloo":
        return "no NCCL group (dry run)", True, ""
    mine = starts_of(hit, 0)
    if mode == "nccl":  # stuck on the GPU in an all-reduce with the dead rank: only an
        # abort frees it (with TORCH_NCCL_ASYNC_ERROR_HANDLING=0 no watchdog does, and
        # not before the group's 60 s timeout anyway)
        ok = len(mine) == 2 and mine[-1]["generation"] == 1 and back < 60
        return "stuck all-reduce released", ok, f"rank 0: {len(mine)} start(s), {back:.1f} s"
    fails = mine[-1]["old_nccl_group_fails"] if mine else None
    return "generation 0's group fails a collective", fails is True, f"it ran ({fails})"


def recovery(ctx: Ctx) -> Section:
    """NCCL abort and in-process recovery of a killed rank, healed live, against an
    uninterrupted run of the same job."""
    out = Section()
    mode, how = probe(not ctx.cuda)
    out.rows.append(("ranks sharing the device", how, "-"))
    ref = launch(ctx.work / "reference", mode, None, RUN_S)
    hit = launch(ctx.work / "fault", mode, FAULT, RUN_S)
    out.result = {
        "mode": mode,
        "reference_s": round(ref["seconds"], 2),
        "fault_run_s": round(hit["seconds"], 2),
    }
    what = f"reference run, {STEPS} steps, no fault"
    if ref["rc"] != 0:
        out.rows.append((what, f"{ref['seconds']:.1f} s", out.check(what, False, failed(ref))))
        return out
    agree = ref["params"][0] is not None and ref["params"][0] == ref["params"][1]
    no_rec = not ref["timeline"]["recoveries"]
    ok = agree and no_rec
    detail = f"ranks agree: {agree}, recoveries: {not no_rec}"
    out.rows.append((what, f"{ref['seconds']:.1f} s", out.check(what, ok, detail, "ranks agree")))
    what = f"{FAULT}, in process, healed live"
    if hit["rc"] != 0:
        out.rows.append((what, f"{hit['seconds']:.1f} s", out.check(what, False, failed(hit))))
        return out
    [rec, *_] = hit["timeline"]["recoveries"] or [{}]
    back = (rec.get("first_step_t") or 0.0) - (rec.get("fault_t") or 0.0)
    out.result |= {"recovery_s": round(back, 3), "detected_by": rec.get("detected_by")}
    ok, detail = healed(hit)
    measured = f"training again {back:.2f} s after the kill ({rec.get('detected_by')})"
    out.rows.append((what, measured, out.check(what, ok, detail, f"both live at step {KILL_STEP}")))
    what = "final parameters against the reference"
    same = hit["params"] == ref["params"]
    out.rows.append((what, "2 ranks", out.check(what, same, "they differ")))
    seen, ok, detail = nccl_check(mode, hit, back)
    what = "NCCL abort on the surviving rank"
    out.rows.append((what, seen, out.check(what, ok, detail, "aborted" if mode != "gloo" else "-")))
    out.result |= {"bitwise": same, "nccl_aborted": ok if mode != "gloo" else None}
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        probe_rank(int(sys.argv[2]), int(sys.argv[3]))
    else:
        job()
