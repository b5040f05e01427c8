"""The demo and the two-rank paths never abort, under CPU load.

    python tests/test_stress.py --runs 50     # the demo and the two-rank tests, 50 times each

runs ``unbroken demo`` (three torchrun launches of a DDP job with DataLoader workers,
background saves, a SIGKILL and a restore) and the two-rank test files N times in a row,
with a busy loop on every core, and fails on the first run that does not exit 0; a gloo
abort (SIGABRT, "terminate called after throwing an instance of 'gloo::EnforceNotMet'")
shows as such. CI runs a bounded version: ``UNBROKEN_STRESS_RUNS`` rounds (default 1,
about 3 minutes on 2 cores).

A test file joins the two-rank files by saying so at module level, on a line of its own:
``TWO_RANK = True`` (`two_rank_files` finds them). Mark the files whose ranks exercise
the checkpointer's gloo group quickly: each adds its run time to every round.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ABORTS = ("EnforceNotMet", "Fatal Python error", "terminate called")
CAUSE = re.compile(r"Traceback|Error|error:|timed out|FAILED")


def two_rank_files(folder: Path = TESTS) -> list[str]:
    """The test files in ``folder`` that declare ``TWO_RANK = True`` on a line of their own."""
    declared = re.compile(r"^TWO_RANK = True\b", re.MULTILINE)
    return sorted(p.name for p in folder.glob("test_*.py") if declared.search(p.read_text()))


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def loaded() -> Iterator[None]:
    """A busy loop on every core, for as long as the block runs."""
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 2)]
    for hog in hogs:
        hog.start()
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()


def _run(cmd: list[str], cwd: Path, timeout: float) -> str | None:
    """None if ``cmd`` exits 0 with no sign of an abort; else what went wrong."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{' '.join(cmd)}: no exit in {timeout:.0f} s"
    out = done.stdout + done.stderr
    aborted = [line for line in out.splitlines() if any(a in line for a in ABORTS)]
    if done.returncode != 0 or aborted:
        return f"{' '.join(cmd)}: exit code {done.returncode}\n" + "\n".join(
            aborted or excerpt(out.splitlines())
        )
    return None


def excerpt(lines: list[str]) -> list[str]:
    """The first error and what follows it (the cause: a launcher's own traceback comes
    last and says only that a rank failed), then the last lines."""
    first = next((i for i, line in enumerate(lines) if CAUSE.search(line)), len(lines) - 30)
    first = max(first, 0)
    head = lines[first : first + 40]
    return [*head, "...", *lines[-20:]] if first + 40 < len(lines) - 20 else lines[first:]


def stress(runs: int, demo: bool = True, tests: bool = True) -> list[str]:
    """Every failure of ``runs`` rounds of the demo and the two-rank tests under load."""
    files = two_rank_files()
    if tests and not files:  # pytest given no file would run every test
        return [f"no test file in {TESTS} declares TWO_RANK = True"]
    failures = []
    with loaded(), tempfile.TemporaryDirectory() as tmp:
        for n in range(runs):
            found: list[str | None] = []
            if demo:
                cmd = [
                    sys.executable,
                    "-m",
                    "unbroken",
                    "demo",
                    "--dir",
                    f"{tmp}/demo-{n}",
                    "--clean",
                ]
                found.append(_run(cmd, Path(tmp), timeout=600))
            if tests:
                cmd = [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-x",
                    "-p",
                    "no:cacheprovider",
                    *files,
                ]
                found.append(_run(cmd, TESTS, timeout=900))
            for failed in filter(None, found):  # at once: a long run is read while it runs
                print(f"round {n + 1} failed: {failed}", flush=True)
            failures += found
            print(
                f"round {n + 1}/{runs}: {sum(f is not None for f in failures)} failed", flush=True
            )
    return [f for f in failures if f is not None]


@pytest.mark.timeout(1200)
def test_the_demo_and_the_two_rank_tests_never_abort_under_load():
    failures = stress(int(os.environ.get("UNBROKEN_STRESS_RUNS", "1")))
    assert not failures, "\n\n".join(failures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--no-demo", action="store_true")
    parser.add_argument("--no-tests", action="store_true")
    opts = parser.parse_args()
    found = stress(opts.runs, demo=not opts.no_demo, tests=not opts.no_tests)
    print("\n\n".join(found) if found else f"{opts.runs} rounds: no failure, no abort")
    sys.exit(1 if found else 0)
