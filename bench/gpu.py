"""unbroken's CUDA paths on one lent GPU, in under 8 minutes: staging against DCP's
stager, the overlapped capture, a restore from memory into device tensors, and NCCL
abort with in-process recovery of a killed rank healed from its live replica.

    python bench/gpu.py                 # needs CUDA; without it says so and exits 0
    python bench/gpu.py --cpu-dry-run   # the same sections on CPU (gloo, no pinned memory)

Each section runs in a process of its own, within a wall-clock budget of its own
(`SECTIONS`, 410 s in all on an H100), and checks what it measures:

staging   unbroken's save (one reused host arena, pinned on CUDA, copies on a side
          stream) against DCP's ``async_save`` with a ``DefaultStager`` (pinned memory,
          non-blocking copies) on the same ~384 MiB model + AdamW state; the pinned
          host copy of the same bytes is the limit. Each method's last save is
          restored into a fresh model on the device and compared bit for bit.
overlap   a training loop saving in the background: unbroken overlapped (its copy
          beside the next forward and backward, settled by the optimizer step
          pre-hook), with ``overlap=False``, and DCP (staging waited for before the
          optimizer step); what each save costs the loop; every save restored, bitwise.
          Then a parameter changed outside ``optimizer.step()`` while its copy runs
          on the side stream: the save must be refused naming it, the step before kept;
          and a state naming the optimizer before the model (its first deferred tensor
          on the CPU: AdamW's ``step``) must save and step as the usual order does.
memory    snapshots of the device state into shared memory, the live state moved on,
          then ``restore``: it must come from memory, the snapshot's step, bitwise.
recovery  `bench/gpu_job.py` under ``unbroken run --in-process``, 2 ranks on the one
          GPU (one NCCL group if torch allows it, else DDP over gloo's CUDA path with a
          one-rank NCCL group per rank: printed), rank 1 killed by ``--inject-fault``:
          rank 0 must keep its process, rank 1 must come back from a warm spare (forked
          from a template that imported torch without initialising CUDA), both must
          heal live at the kill's step, the survivor's NCCL group must be aborted, and
          the final parameters must equal an uninterrupted run's (ranks started cold),
          bit for bit.

Prints one table, then ``RESULT {json}`` as its last line; exits 1 on any wrong value,
a section that fails, or one over its budget. The CPU test suite never runs it. The
sections live in bench/gpu_sections.py (the comparisons with DCP, and what all share),
bench/gpu_checks.py (memory, and the overlap's checks) and bench/gpu_job.py (recovery,
and the job it launches); every process started runs the library of this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common import new_table, print_result, show

if TYPE_CHECKING:  # imported where a section runs: with the checkout's library on the path
    from gpu_sections import Ctx, Section

HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src"  # the checkout's library, not whichever is installed
# name: (wall-clock budget in seconds on an H100, what it covers)
SECTIONS: dict[str, tuple[float, str]] = {
    "staging": (70, "CUDA staging"),
    "overlap": (80, "overlapped capture"),
    "memory": (50, "restore from memory"),
    "recovery": (210, "NCCL abort, in-process recovery"),
}
DRY_SCALE = 0.5  # --cpu-dry-run: the budgets, scaled (a tiny state on a CPU)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the sections on CPU tensors (gloo, no pinned memory, no NCCL)",
    )
    p.add_argument("--mib", type=int, help="model + AdamW state, MiB (384 on CUDA, 16 dry)")
    p.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # a child's
    p.add_argument("--work", help=argparse.SUPPRESS)
    return p.parse_args()


def run_section(opts: argparse.Namespace) -> None:
    """In the child: run one section, print its outcome as the last line, and leave at
    once: a wrong value can leave a background save waiting forever (the section said
    so), and the interpreter's exit would wait for it (`unbroken.saving.at_exit`)."""
    from gpu_checks import memory, overlap_checks
    from gpu_job import recovery
    from gpu_sections import Ctx, overlap, staging

    cuda = not opts.cpu_dry_run
    ctx = Ctx(
        device="cuda" if cuda else "cpu",
        mib=opts.mib or (384 if cuda else 16),
        batch=4096 if cuda else 8,  # on an H100: a step of ~15 ms, a copy to hide in it
        work=Path(opts.work),
    )
    sections: dict[str, Callable[[Ctx], Section]] = {
        "staging": staging,
        "overlap": lambda ctx: overlap_checks(ctx, overlap(ctx)),
        "memory": memory,
        "recovery": recovery,
    }
    got = sections[opts.section](ctx)
    print("SECTION " + json.dumps({"rows": got.rows, "wrong": got.wrong, "result": got.result}))
    sys.stdout.flush()
    os._exit(0)


def spawn(name: str, budget_s: float, opts: argparse.Namespace, root: str) -> dict[str, Any]:
    """Run section ``name`` in a process of its own, killed (with what it started)
    past ``budget_s``; its outcome, or the reason there is none."""
    work = Path(root) / name
    work.mkdir()
    cmd = [sys.executable, str(HERE), "--section", name, "--work", str(work)]
    cmd += ["--cpu-dry-run"] * opts.cpu_dry_run + ([f"--mib={opts.mib}"] if opts.mib else [])
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nover its budget of {budget_s:.0f} s: stopped"
    seconds = time.monotonic() - start
    last = (out.strip().splitlines() or [""])[-1]
    if proc.returncode == 0 and last.startswith("SECTION "):
        return json.loads(last.removeprefix("SECTION ")) | {"seconds": seconds}
    tail = [ln for ln in err.splitlines() if ln.strip()][-4:]
    why = f"exit {proc.returncode}: {' | '.join(tail)[-400:]}"
    return {
        "rows": [["(section failed)", "-", f"WRONG: {why}"]],
        "wrong": [why],
        "result": {},
        "seconds": seconds,
    }


def device_line(dry: bool) -> str:
    if dry:
        return f"CPU dry run (--cpu-dry-run), torch {torch.__version__}"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a build without NCCL
        nccl = "none"
    name = torch.cuda.get_device_name(0)
    return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"


def report(outcomes: dict[str, dict[str, Any]], dry: bool, total_s: float) -> bool:
    """The table and the RESULT line; whether every check held."""
    table = new_table(
        f"unbroken on {device_line(dry)}",
        f"{total_s:.0f} s in all; each section in its own process, within its budget",
        [
            ("section", "left"),
            ("what", "left"),
            ("measured", "left"),
            ("check", "left"),
            ("time", "right"),
        ],
    )
    result: dict[str, Any] = {"cuda": not dry, "dry_run": dry, "seconds": round(total_s, 1)}
    wrong: list[str] = []
    for name, got in outcomes.items():
        budget = SECTIONS[name][0] * (DRY_SCALE if dry else 1.0)
        for i, (what, measured, check) in enumerate(got["rows"]):
            spent = f"{got['seconds']:.0f}/{budget:.0f} s" if i == 0 else ""
            table.add_row(name if i == 0 else "", what, measured, check, spent)
        wrong += [f"{name}: {w}" for w in got["wrong"]]
        result[name] = got["result"] | {"seconds": round(got["seconds"], 1)}
    result["wrong"] = wrong
    show(170, table)
    for line in wrong:
        print(f"WRONG {line}")
    print_result(result)
    return not wrong


def main() -> int:
    opts = parse()
    if opts.section:
        run_section(opts)  # does not return
    if not opts.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA device here: bench/gpu.py measures nothing (--cpu-dry-run runs it on CPU)")
        print_result({"cuda": False})
        return 0
    if (SRC / "unbroken").is_dir():  # for every process it starts, the launcher's included
        paths = [str(SRC), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    root = tempfile.mkdtemp(prefix="unbroken-gpu-")
    start = time.monotonic()
    try:
        outcomes = {}
        for name, (budget_s, what) in SECTIONS.items():
            budget_s *= DRY_SCALE if opts.cpu_dry_run else 1.0
            print(f"{name}: {what} (budget {budget_s:.0f} s)", flush=True)
            outcomes[name] = spawn(name, budget_s, opts, root)
        ok = report(outcomes, opts.cpu_dry_run, time.monotonic() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
