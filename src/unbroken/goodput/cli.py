"""``unbroken goodput RUN_DIR``: where a launch's time went, from its event logs.

Prints goodput and badput by cause (`unbroken.goodput.account`), or ``--json``; writes a
self-contained HTML report (``--html``, default ``RUN_DIR/goodput.html``) and, where
matplotlib is installed, a PNG timeline (``--png``, default ``RUN_DIR/goodput.png``),
both with `Access.from_env`'s file mode (0600) whatever the umask, as the event logs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from unbroken.access import Access
from unbroken.goodput import html
from unbroken.goodput.account import Account, account
from unbroken.goodput.report import text
from unbroken.run import rundir


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="unbroken goodput",
        description="Goodput of an `unbroken run` launch, and badput by cause, from the "
        "event logs in its run directory (printed at the end of `unbroken run`).",
    )
    p.add_argument("run_dir", type=Path, help="the run directory")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--html", type=Path, help="HTML report (default RUN_DIR/goodput.html)")
    p.add_argument("--png", type=Path, help="PNG timeline (default RUN_DIR/goodput.png)")
    p.add_argument("--no-files", action="store_true", help="write neither the HTML nor PNG")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        a = account(rundir.read(args.run_dir))
    except (FileNotFoundError, ValueError) as e:
        print(f"unbroken goodput: {e}", file=sys.stderr)
        return 2
    where = str(args.run_dir)
    if args.json:
        print(json.dumps(a.to_json()))
    else:
        print(text(a, where))
    if args.no_files:
        return 0
    try:
        return _write_files(args, a, where)
    except OSError as e:  # a missing folder, say: the path and why, in one line
        print(f"unbroken goodput: cannot write the report: {e}", file=sys.stderr)
        return 2


def _write_files(args: argparse.Namespace, a: Account, where: str) -> int:
    page = args.html or args.run_dir / "goodput.html"
    Access.from_env().write_text(str(page), html.page(a, where))
    wrote = [str(page)]
    from unbroken.goodput import plot

    if plot.have_matplotlib():
        png = args.png or args.run_dir / "goodput.png"
        plot.timeline(a, where, png)
        wrote.append(str(png))
    elif args.png is not None:
        print(
            "unbroken goodput: --png needs matplotlib: pip install 'unbroken[plot]'",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {', '.join(wrote)}", file=sys.stderr)
    return 0
