"""Crash-consistency trials: SIGKILL a saving process at random moments, then check that
restore gives exactly the newest committed step, bitwise, or the one before it.

Run as a script (tests/test_crash.py does)::

    python tests/crash_harness.py --uri DIR_OR_S3 [--options JSON] --trials N --seed S

One process imports torch once, then forks a child per trial. Each child is a job
restarting after the previous trial's crash: it restores (checked against the steps the
previous child began and finished), arms a crash fault, and saves the next steps until it
is killed, at a named crash point (`unbroken.run.faults.POINTS`) or by the parent at a
random time. The last line printed is a JSON summary: trials, kills by point, failures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import sys
import time
from collections import Counter
from typing import Any

import torch

from unbroken import Checkpointer
from unbroken.run import faults

SAVES = 4  # steps a child saves, unless killed first
KEEP = 2  # retention: deletes run while the trials save
SIZE = 1 << 17  # elements per tensor: about 1.5 MiB a step in three tensors


def expected(step: int) -> dict[str, Any]:
    """The state saved as ``step``: every tensor and value says which step it is."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(SIZE, generator=g),
            "b": torch.arange(SIZE // 4, dtype=torch.int64) * step,
        },
        "optim": {"m": torch.full((SIZE // 2,), float(step), dtype=torch.float64)},
        "meta": {"step": step, "name": f"step-{step}"},
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(SIZE), "b": torch.zeros(SIZE // 4, dtype=torch.int64)},
        "optim": {"m": torch.zeros(SIZE // 2, dtype=torch.float64)},
        "meta": {"step": -1, "name": ""},
    }


def mismatch(state: dict[str, Any], step: int) -> str | None:
    """What in ``state`` differs from ``expected(step)``, bitwise, or None."""
    want = expected(step)
    for group in ("model", "optim"):
        for key, t in want[group].items():
            if not torch.equal(state[group][key], t):
                return f"{group}.{key} is not step {step}'s"
    if state["meta"] != want["meta"]:
        return f"meta is {state['meta']}, not step {step}'s"
    return None


def child(uri: str, options: dict[str, Any] | None, spec: str, out: int) -> None:
    """One restarted job: restore, report, arm ``spec``, save until killed."""

    def say(*fields: Any) -> None:
        os.write(out, (json.dumps(fields) + "\n").encode())

    torch.set_num_threads(1)
    ckpt = Checkpointer(uri, storage_options=options, keep=KEEP)
    state = blank()
    try:
        step = ckpt.restore(state)
        say("restored", step, None if step is None else mismatch(state, step))
    except Exception as e:
        say("restored", None, f"restore failed: {type(e).__name__}: {e}")
        os._exit(1)
    faults.arm(spec)
    start = (step or 0) + 1
    for step in range(start, start + SAVES):
        say("begin", step)
        ckpt.save(step, expected(step), blocking=step % 2 == 0).wait()
        say("done", step)
    ckpt.close()
    os._exit(0)


def trial(
    uri: str, options: dict[str, Any] | None, spec: str, kill_after: float | None
) -> list[list[Any]]:
    """Fork a child, kill it ``kill_after`` seconds after it restored (or let its crash
    point kill it); the lines it reported."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            child(uri, options, spec, write)
        finally:
            os._exit(2)
    os.close(write)
    lines: list[list[Any]] = []
    buffer = b""
    deadline: float | None = None
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read], [], [], timeout)
        if not ready:  # the random moment has come
            os.kill(pid, signal.SIGKILL)
            deadline = None
            continue
        data = os.read(read, 1 << 16)
        if not data:
            break
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            lines.append(json.loads(line))
            if lines[-1][0] == "restored" and kill_after is not None:
                deadline = time.monotonic() + kill_after
    os.close(read)
    os.waitpid(pid, 0)
    return lines


def run(uri: str, options: dict[str, Any] | None, trials: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    points = [p for p in faults.POINTS if p in SAVE_POINTS]
    if uri.startswith("s3://"):
        points.remove("fsync")  # no fsync on object stores
    kills: Counter[str] = Counter()
    failures: list[str] = []
    allowed: set[int | None] = {None}  # what the next restore may give
    floor: int | None = None  # the newest step whose save returned
    durations = [0.3]
    started = time.monotonic()
    for n in range(trials + 1):  # the last child only restores and checks
        if n == trials:
            spec, kill_after, label = "", 0.0, "final"
        elif rng.random() < 0.3:
            spec, label = "", "random-time"
            # a child's run counts its start and restore too: kill within its saves
            kill_after = rng.uniform(0, 0.6 * sum(durations[-5:]) / len(durations[-5:]))
        else:
            label = rng.choice(points)
            spec, kill_after = f"crash point={label} hit={rng.randint(1, 2)}", None
        begun = time.monotonic()
        lines = trial(uri, options, spec, kill_after)
        restored = [line for line in lines if line[0] == "restored"]
        if not restored:
            failures.append(f"trial {n}: the child reported no restore: {lines}")
            break
        _, step, bad = restored[0]
        if bad or step not in allowed or (floor is not None and (step is None or step < floor)):
            failures.append(
                f"trial {n} ({label}): restored step {step} ({bad or 'bitwise equal'}); "
                f"allowed {sorted(allowed, key=str)}, newest finished save {floor}"
            )
            break
        done = [line[1] for line in lines if line[0] == "done"]
        begun_steps = [line[1] for line in lines if line[0] == "begin"]
        floor = done[-1] if done else step
        allowed = {floor, *(begun_steps[-1:] if begun_steps else [])}
        if len(done) == SAVES:
            durations.append(time.monotonic() - begun)
        if n < trials:
            kills[label if len(done) < SAVES else f"{label} (not reached)"] += 1
    return {
        "uri": "s3" if uri.startswith("s3://") else "local",
        "trials": trials,
        "kills": dict(sorted(kills.items())),
        "failures": failures,
        "seconds": round(time.monotonic() - started, 1),
    }


# The points a single-process save reaches (the others need snapshots or several ranks).
SAVE_POINTS = {
    "stage", "data-write", "fsync", "data-written", "manifest-commit", "committed",
    "latest-pointer", "retention-gc", "leftover-clear",
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--uri", required=True)
    parser.add_argument("--options", default=None, help="storage options, as JSON")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    options = json.loads(args.options) if args.options else None
    summary = run(args.uri, options, args.trials, args.seed)
    print(json.dumps(summary), flush=True)
    sys.exit(1 if summary["failures"] else 0)


if __name__ == "__main__":
    main()
