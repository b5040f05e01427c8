"""How long the `unbroken` command takes to start: ``--help``, ``ls``, ``show`` and
``verify`` on a small checkpoint, each a fresh process, against the targets of the first
hour (``--help`` under 0.5 s, ``ls`` under 1 s), with bare Python and ``import torch``
measured side by side as the floor and the cost these commands must not pay.

    python bench/cli_startup.py [--runs 5]

Prints one table; the last line is ``RESULT {json}``. Each figure is the median of
``--runs`` runs of ``python -m unbroken ...`` (what the ``unbroken`` script runs, without
a shim such as pyenv's in front of it). "torch" says whether the command imported torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The command, run as the `unbroken` script runs it, telling whether it imported torch.
PROBE = (
    "import sys\n"
    "from unbroken.cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    "sys.stderr.write('\\nTORCH=%d\\n' % ('torch' in sys.modules))\n"
    "sys.exit(code)\n"
)
TARGETS = {"--help": 0.5, "ls": 1.0, "show": 1.0, "verify": 1.0}


def make_checkpoint(path: Path) -> None:
    """Three steps of a small model: a checkpoint as the first hour leaves one."""
    import torch

    import unbroken

    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    optim = torch.optim.Adam(net.parameters())
    with unbroken.Checkpointer(path) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, {"model": net, "optim": optim})


def timed(argv: list[str], runs: int) -> float:
    """The median wall time of ``runs`` runs of ``argv`` (each must exit 0)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-500:]}")
    return statistics.median(times)


def imports_torch(args: list[str]) -> bool:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True)
    return "TORCH=1" in proc.stderr


def measure(ckpt: Path, runs: int) -> dict[str, Any]:
    commands = {
        "--help": ["--help"],
        "ls": ["ls", str(ckpt)],
        "show": ["show", str(ckpt)],
        "verify": ["verify", str(ckpt), "--quiet"],
    }
    rows: dict[str, Any] = {}
    for name, args in commands.items():
        seconds = timed([sys.executable, "-m", "unbroken", *args], runs)
        rows[name] = {
            "median_s": round(seconds, 3),
            "target_s": TARGETS[name],
            "ok": seconds < TARGETS[name],
            "torch": imports_torch(args),
        }
    return {
        "runs": runs,
        "python_s": round(timed([sys.executable, "-c", "pass"], runs), 3),
        "import_torch_s": round(timed([sys.executable, "-c", "import torch"], runs), 3),
        "commands": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"median of {result['runs']} runs, each a fresh process",
        f"  {'command':<22}{'seconds':>9}{'target':>9}{'':>6}{'torch':>7}",
    ]
    for name, r in result["commands"].items():
        verdict = "PASS" if r["ok"] else "FAIL"
        torch = "yes" if r["torch"] else "no"
        lines.append(
            f"  unbroken {name:<13}{r['median_s']:>9.2f}{r['target_s']:>9.1f}{verdict:>6}{torch:>7}"
        )
    lines.append(f"  {'python -c pass':<22}{result['python_s']:>9.2f}")
    lines.append(f"  {'python -c import torch':<22}{result['import_torch_s']:>9.2f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs per command (median)")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "run"
        make_checkpoint(ckpt)
        result = measure(ckpt, args.runs)
    print(table(result))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
