"""The run directory: where `unbroken run` keeps a launch's events for `unbroken goodput`.

`unbroken run` uses it as its heartbeat directory, so the workers' events
(``events-<RANK>-<PID>.jsonl``, with ``reached-<RANK>-<PID>``) and the launcher's
(``launcher.jsonl``) land there as they happen; at the end, the heartbeat files and
fault markers are removed and the events stay. ``$UNBROKEN_RUN_DIR`` names it (new or
empty); by default it is a new folder under ``$XDG_STATE_HOME/unbroken/runs``
(``~/.local/state/...``), named after the time and the launcher's pid, and printed at
the end.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from unbroken.access import Access
from unbroken.run import contract, reached

TRANSIENT = (contract.HEARTBEAT_PREFIX, contract.FIRED_PREFIX, contract.KILL_NODE_PREFIX, ".")


def default_root() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "unbroken" / "runs"


def new_dir() -> Path:
    """The run directory for a new launch: ``$UNBROKEN_RUN_DIR``, or a new default one.
    Raises SystemExit (a usage error) if ``$UNBROKEN_RUN_DIR`` holds anything."""
    given = os.environ.get(contract.RUN_DIR_ENV)
    if given:
        path = Path(given)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise SystemExit(
                f"unbroken run: {contract.RUN_DIR_ENV}={given} is not an empty directory; "
                "name a new one (events of two launches must not mix)"
            )
    else:
        path = default_root() / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    # The job's user's alone (0700, or 0770 with group access): the events name hosts,
    # pids and paths, and heartbeats written here steer the launcher's watchdog.
    Access.from_env().makedirs(str(path))
    return path


@contextmanager
def run_directory() -> Iterator[str]:
    """A new run directory (`new_dir`) for the launch; on exit, only the events stay."""
    path = new_dir()
    try:
        yield str(path)
    finally:
        for name in os.listdir(path):
            if name.startswith(TRANSIENT):
                (path / name).unlink(missing_ok=True)


def read(path: str | Path) -> list[dict[str, Any]]:
    """Every event in a run directory (workers' and launcher's, and the step each worker
    last reached as a ``reached`` event: `unbroken.run.reached`), by time. Raises
    FileNotFoundError naming the directory if it holds no events."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such run directory")
    files = sorted(root.glob(f"{contract.EVENTS_PREFIX}*.jsonl"))
    launcher = root / contract.LAUNCHER_EVENTS
    if launcher.exists():
        files.append(launcher)
    if not files:
        raise FileNotFoundError(
            f"{root}: no event logs ({contract.EVENTS_PREFIX}*.jsonl) here; give the "
            "directory `unbroken run` printed at its end"
        )
    events = []
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill: the rest still counts
    events += reached.read(root)
    return sorted(events, key=lambda e: e["t"])
