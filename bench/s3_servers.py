"""The S3 servers bench/s3.py can start on loopback (Ceph RGW, moto), and the audit of the
CPU that other processes took while it ran."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import GIB, free_port

REPO = Path(__file__).resolve().parent.parent


class CpuAudit:
    """CPU seconds that processes other than the bench's took while it ran: the machine's
    busy time (/proc/stat) minus this process's (moto runs in it), its children's (the
    ranks, once joined) and the RGW daemons'. A large figure means the run competed with
    someone else's work on this shared VM."""

    def __init__(self, daemons: list[int]) -> None:
        self.daemons = daemons
        self.started = time.monotonic()
        self.start = self.snapshot()

    def snapshot(self) -> tuple[float, float]:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:  # user nice system idle iowait irq softirq
            user, nice, system, _, _, irq, softirq = (int(x) for x in f.readline().split()[1:8])
        t = os.times()
        ours = t.user + t.system + t.children_user + t.children_system
        for pid in self.daemons:
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ours += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        # (interrupt time is charged to the process that was running: count it on both sides)
        return (user + nice + system + irq + softirq) / tick, ours

    def others(self) -> dict[str, float]:
        busy, ours = self.snapshot()
        wall = time.monotonic() - self.started
        other = max(0.0, (busy - self.start[0]) - (ours - self.start[1]))
        return {"cpu_s": other, "wall_s": wall, "cores": other / wall}


def daemon_pids(directory: Path) -> list[int]:
    pids = []
    for path in (directory / "run").glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(path.read_text()))
    return pids


def start_moto(stack: contextlib.ExitStack) -> str:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    stack.callback(server.stop)
    return f"http://127.0.0.1:{port}"


def start_rgw(stack: contextlib.ExitStack, directory: Path, memstore: int) -> Any:
    sys.path.insert(0, str(REPO / "tests"))
    from servers.rgw import RGWUnavailable, start_rgw

    # the OSD keeps every object in RAM, up to this many bytes
    os.environ.setdefault("RGW_MEMSTORE_BYTES", str(memstore))
    os.environ.setdefault("RGW_GC_PERIOD", "86400")  # collected between clocks instead
    try:
        rgw = start_rgw(directory)
    except RGWUnavailable as e:
        raise SystemExit(
            f"Ceph RGW could not start: {e.reason}\n(run with --server moto, or --endpoint "
            "for a server of your own)"
        ) from None
    stack.callback(rgw.stop)
    return rgw


def memstore_bytes(cfg_total: int, replicated: int, repeats: int) -> int:
    """Room for every object the run writes (deleted objects are reclaimed only by RGW's
    garbage collection, which the bench runs after each repeat), capped by what this
    machine can spare."""
    need = int(1.3 * (repeats * (4 * cfg_total + replicated) + cfg_total)) + GIB
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    ranks_need = 4 * cfg_total + 3 * replicated
    return max(4 * GIB, min(need, (available - ranks_need) // 2))


def ceph_version() -> str:
    try:
        out = subprocess.run(["radosgw", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "?"
    found = re.search(r"ceph version (\S+)", out)
    return found.group(1) if found else "?"
