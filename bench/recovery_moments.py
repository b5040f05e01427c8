"""Steps lost when a node dies at a random moment of a step: scenario (h) of
bench/recovery.py, and on its own:

    python bench/recovery_moments.py --kills 50

Each trial runs bench/recovery_worker.py with live healing (``ckpt.step`` every step, a
snapshot every step with a replica on the other node) under ``unbroken run --in-process
--simulate-nodes=2 --nproc-per-node=2``. Once every rank trains, the bench waits a
uniformly random time within the training run and SIGKILLs both ranks of a random node
(rank 0's included): the moment falls anywhere in a step (data, forward, the gradient
exchange, the optimizer, the record, the snapshot). Per trial:

* *lossless*: no surviving rank was healed back to a step older than the one it held
  (a fallback to snapshots, or a heal at an older step, redoes a step it had applied).
  Most keep their own live state; a survivor stopped in the step's barrier before
  applying it is healed *forward* to the step the others applied (`unbroken.healing
  .inflight`), which redoes nothing: those kills are counted apart, as *forward*;
* *bitwise*: every rank's final loss equals the uninterrupted run's, bit for bit;
* the seconds from the kill to the first step after it.

What it compares against: the same kills before `unbroken.healing.inflight` lost a step
whenever the node died between a step's gradient exchange and its record (6 of 16 in
the issue that asked for this). Prints one table and ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from recovery_jobs import WORKER, read_events

STEPS = 80
LAUNCH = ["--in-process", "--simulate-nodes=2", "--nproc-per-node=2", "--max-restarts=3"]


def job(where: Path, kill: tuple[float, int] | None) -> dict[str, Any]:
    """Run one job in ``where``; with ``kill`` = (fraction of the run, node), SIGKILL
    that node's ranks at that moment. The workers' events and the kill's time."""
    import subprocess

    events = where / "events"
    events.mkdir(parents=True)
    cmd = [sys.executable, "-m", "unbroken", "run", *LAUNCH, str(WORKER),
           f"--out={events}", f"--ckpt={where / 'ckpt'}", f"--steps={STEPS}",
           "--save-every=1000", "--memory-every=1", "--replicas=1", "--mib-per-rank=2",
           "--live"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_MEMORY_DIR": str(where / "shm")}
    with open(where / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        killed_t = None
        if kill is not None:
            killed_t = _kill_at(events, kill)
        code = proc.wait(timeout=300)
    if code != 0 and not (kill is not None and killed_t is None):
        tail = (where / "launcher.log").read_text()[-3000:]
        raise RuntimeError(f"the job exited {code}:\n{tail}")
    return {"events": read_events(events), "killed_t": killed_t}


def _kill_at(events: Path, kill: tuple[float, int]) -> float | None:
    """Wait until every rank trains, then until ``kill[0]`` of the run's expected length
    has passed; SIGKILL the ranks of node ``kill[1]``. When it happened (wall clock),
    None if training had ended by then."""
    fraction, node = kill
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = read_events(events)
        started = [e for e in found if e["event"] == "loss"]
        if len(started) == 4:
            break
        time.sleep(0.02)
    else:
        raise RuntimeError("the job never started training")
    time.sleep(fraction * RUN_S)
    if any(e["event"] == "done" for e in read_events(events)):
        return None  # the run was faster than the reference's: no kill, drawn again
    pids = {e["pid"] for e in found if e["rank"] in (2 * node, 2 * node + 1)}
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return time.time()


RUN_S = 3.0  # the training part of a run, measured by `reference` (then overwritten)


def reference(where: Path) -> dict[int, float]:
    """The uninterrupted run's final loss per rank; sets `RUN_S` from its length."""
    global RUN_S
    found = job(where, None)["events"]
    first = min(e["t"] for e in found if e["event"] == "loss")
    done = {e["rank"]: e for e in found if e["event"] == "done"}
    RUN_S = max(e["t"] for e in done.values()) - first
    return {rank: e["loss"] for rank, e in done.items()}


def trial(where: Path, ref: dict[int, float], rng: random.Random) -> dict[str, Any]:
    """One kill at a random moment (drawn again if the run ended first)."""
    for attempt in range(5):
        node, fraction = rng.randrange(2), rng.uniform(0.05, 0.7)
        run = job(where / str(attempt), (fraction, node))
        if run["killed_t"] is not None:
            break
    else:
        raise RuntimeError("five runs in a row ended before their kill")
    found, killed_t = run["events"], run["killed_t"]
    lost = {2 * node, 2 * node + 1}
    after = [e for e in found if e["event"] == "restore_end" and e["t"] > killed_t]
    survivors = [e for e in after if e["rank"] not in lost]
    done = {e["rank"]: e["loss"] for e in found if e["event"] == "done"}
    firsts: dict[int, float] = {}
    for e in sorted(found, key=lambda e: e["t"]):
        if e["event"] == "step_done" and e["t"] > killed_t:
            firsts.setdefault(e["rank"], e["t"])
    return {
        "node": node,
        "at": round(fraction, 3),
        "restored": sorted({e["restored"] for e in after}, key=str),
        "lossless": bool(survivors) and all((e["restored"] or 0) >= e["held"] for e in survivors),
        "forward": any((e["restored"] or 0) > e["held"] for e in survivors),
        "bitwise": done == ref,
        "seconds": round(max(firsts.values()) - killed_t, 3) if len(firsts) == 4 else None,
    }


def run(kills: int, where: Path, seed: int | None = None) -> dict[str, Any]:
    """``kills`` trials in ``where`` after an uninterrupted reference run: the summary."""
    rng = random.Random(seed)
    ref = reference(where / "reference")
    results = []
    for n in range(kills):
        results.append(r := trial(where / f"trial-{n}", ref, rng))
        print(f"kill {n + 1:>2}: node {r['node']} at {r['at']:.2f} of the run, "
              f"restored {r['restored']}, lossless {r['lossless']}, forward {r['forward']}, "
              f"bitwise {r['bitwise']}, "
              f"{r['seconds']} s", file=sys.stderr)  # fmt: skip
    seconds = [r["seconds"] for r in results if r["seconds"] is not None]
    return {
        "kills": kills,
        "lossless": sum(r["lossless"] for r in results),
        "forward": sum(r["forward"] for r in results),
        "bitwise": sum(r["bitwise"] for r in results),
        "median_recovery_s": statistics.median(seconds) if seconds else None,
        "trials": results,
    }


def table(summary: dict[str, Any]) -> None:
    median = summary["median_recovery_s"]
    print(f"{'kills at random moments':<28} {'lossless':>9} {'of which forward':>17} "
          f"{'bitwise':>8} {'median s':>9}")  # fmt: skip
    print(f"{summary['kills']:<28} {summary['lossless']:>9} {summary['forward']:>17} "
          f"{summary['bitwise']:>8} {'-' if median is None else f'{median:.2f}':>9}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", type=Path, help="run in this (new) folder and keep it")
    args = p.parse_args()
    if args.keep:
        summary = run(args.kills, args.keep, args.seed)
    else:
        with tempfile.TemporaryDirectory(prefix="moments-") as tmp:
            summary = run(args.kills, Path(tmp), args.seed)
    print()
    table(summary)
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
