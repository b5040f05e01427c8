"""What the goodput event log costs a training step: ``python bench/goodput_events.py``.

One process trains a small MLP on CPU (forward, backward, AdamW: a few milliseconds a
step) in alternating blocks with the event log off (no ``$UNBROKEN_EVENTS_DIR``: `tick`
is a dictionary lookup) and on (every step's span buffered, a blocking-save's events
every ``--save-every`` steps, everything written at most once a second). Reported: the
median step time of each, the log's cost per step measured directly (a tight loop of
ticks, flushes included), that cost against the step, and the writes per step. Target:
under 0.5 % of the step, at most one write per step. Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import new_table, print_result, show
from unbroken.run import contract, worker

TARGET = 0.005  # the log's cost, as a share of the step


def model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )
    return net, torch.optim.AdamW(net.parameters()), torch.randn(64, width)


def block(
    net: Any, opt: Any, x: torch.Tensor, steps: int, first: int, save_every: int
) -> list[float]:
    """``steps`` training steps from step ``first``; each step's seconds."""
    times = []
    for step in range(first, first + steps):
        t0 = time.perf_counter()
        loss = net(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        worker.tick(step)
        if step % save_every == 0:  # what a Checkpointer's save records around itself
            worker.event("save_start", step=step, blocking=True)
            worker.event("save_end", step=step)
        times.append(time.perf_counter() - t0)
    return times


def logging(on: bool, directory: str) -> None:
    """Turn the event log on (into ``directory``) or off, as a new process would see it."""
    if on:
        os.environ[contract.EVENTS_DIR_ENV] = directory
    else:
        os.environ.pop(contract.EVENTS_DIR_ENV, None)
    worker.reset()


def tick_cost(directory: str, n: int) -> float:
    """Seconds per logged tick, flushes included: many ticks, then the flush of the rest."""
    logging(True, directory)
    t0 = time.perf_counter()
    for step in range(10**9, 10**9 + n):
        worker.tick(step)
    worker.flush()
    return (time.perf_counter() - t0) / n


def measure(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    net, opt, x = model(args.width)
    block(net, opt, x, 5, 1, args.save_every)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    step = 10
    for r in range(args.rounds):
        for logged in (False, True) if r % 2 == 0 else (True, False):
            logging(logged, directory)
            times[logged] += block(net, opt, x, args.steps, step, args.save_every)
            step += args.steps
    logging(False, directory)
    files = list(Path(directory).glob("events-*.jsonl"))
    lines = sum(len(f.read_text().splitlines()) for f in files)
    per_tick = tick_cost(directory, 50_000)
    logging(False, directory)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {
        "step_s_off": round(off, 6),
        "step_s_on": round(on, 6),
        "difference": round(on / off - 1, 4),
        "log_s_per_step": round(per_tick, 9),
        "log_share": round(per_tick / off, 6),
        "lines_per_step": round(lines / len(times[True]), 4),
        "steps_logged": len(times[True]),
        "pass": per_tick / off < TARGET,
    }


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    table = new_table(
        f"goodput event log: MLP {args.width}x{args.width}, batch 64, CPU, "
        f"{args.rounds} rounds x {args.steps} steps per mode",
        "log cost: a tight loop of logged ticks (flushes included) / median step, log off",
        [("measure", "left"), ("value", "right")],
    )
    table.add_row("step, log off (median)", f"{1000 * r['step_s_off']:.3f} ms")
    table.add_row("step, log on (median)", f"{1000 * r['step_s_on']:.3f} ms")
    table.add_row("difference (noise included)", f"{100 * r['difference']:+.2f} %")
    table.add_row("log cost per step", f"{1e6 * r['log_s_per_step']:.2f} us")
    verdict = "PASS" if r["pass"] else "FAIL"
    table.add_row("log cost / step", f"{100 * r['log_share']:.3f} % ({verdict}: < 0.5 %)")
    table.add_row("event lines written per step", f"{r['lines_per_step']:.3f}")
    show(100, table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512, help="MLP width (512)")
    p.add_argument("--steps", type=int, default=200, help="steps per block (200)")
    p.add_argument("--rounds", type=int, default=6, help="blocks per mode (6)")
    p.add_argument("--save-every", type=int, default=50, help="save events every (50)")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="unbroken-events-") as directory:
        result = measure(args, directory)
    report(args, result)
    print_result({"config": vars(args), **result})


if __name__ == "__main__":
    main()
