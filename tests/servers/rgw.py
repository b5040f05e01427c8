"""Start a throwaway Ceph RGW (S3) server for tests, using ``rgw.sh`` next to this file.

    rgw = start_rgw(tmp_path / "rgw")  # raises RGWUnavailable(reason) if it cannot
    ...  # S3 at rgw.endpoint with rgw.access_key / rgw.secret_key, region rgw.region
    rgw.stop()

The server is a single-node Ceph cluster (one monitor, one in-memory OSD, radosgw) whose
files all live in the given directory. It needs the Debian packages ceph-mon, ceph-osd,
radosgw and ceph-common.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SCRIPT = Path(__file__).with_name("rgw.sh")
PROGRAMS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool", "timeout")
PACKAGES = "ceph-mon ceph-osd radosgw ceph-common"
START_TIMEOUT_S = 60  # given to rgw.sh; a clean start takes a few seconds


class RGWUnavailable(RuntimeError):
    """No RGW server could be started; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class RGW:
    """A running RGW server. ``stop()`` kills its daemons (it is safe to call twice)."""

    endpoint: str
    access_key: str
    secret_key: str
    directory: Path
    region: str = "us-east-1"
    _stopped: bool = field(default=False, repr=False, compare=False)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        _stop_daemons(self.directory)


def _stop_daemons(directory: Path) -> None:
    subprocess.run(
        ["bash", str(SCRIPT), "stop", str(directory)],
        check=False,
        capture_output=True,
        timeout=60,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_rgw(directory: Path, port: int | None = None) -> RGW:
    """Start RGW with its cluster in ``directory``, serving S3 on 127.0.0.1:``port``.

    With ``port=None`` a free port is picked. Raises ``RGWUnavailable`` when the Ceph
    programs are missing or the server does not come up.
    """
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        raise RGWUnavailable(
            f"Ceph RGW not installed (missing {', '.join(missing)}); apt-get install {PACKAGES}"
        )
    if shutil.which("bash") is None:
        raise RGWUnavailable("bash not found")
    directory = Path(directory).resolve()
    env = dict(os.environ, PYTHON=sys.executable, RGW_START_TIMEOUT=str(START_TIMEOUT_S))
    # A picked port may be taken by someone else before radosgw binds it: try a few.
    attempts = 3 if port is None else 1
    reason = ""
    for _ in range(attempts):
        chosen = _free_port() if port is None else port
        try:
            proc = subprocess.run(
                ["bash", str(SCRIPT), str(directory), str(chosen)],
                check=False,
                capture_output=True,
                text=True,
                env=env,
                timeout=START_TIMEOUT_S + 30,
            )
        except subprocess.TimeoutExpired:
            _stop_daemons(directory)
            raise RGWUnavailable(f"rgw.sh did not finish within {START_TIMEOUT_S + 30} s") from None
        if proc.returncode == 0:
            return _parse(proc.stdout, directory)
        stderr = proc.stderr.strip()
        # rgw.sh ends with a one-line reason; put it first, then the log tails before it.
        headline = stderr.splitlines()[-1] if stderr else "no output"
        reason = f"{headline} (exit {proc.returncode})\n{stderr[-4000:]}"
        if "already in use" not in proc.stderr:
            break
    raise RGWUnavailable(reason)


def _parse(stdout: str, directory: Path) -> RGW:
    for line in stdout.splitlines():
        if line.startswith("RGW_ENDPOINT="):
            fields = dict(item.split("=", 1) for item in line.split())
            rgw = RGW(
                endpoint=fields["RGW_ENDPOINT"],
                access_key=fields["ACCESS_KEY"],
                secret_key=fields["SECRET_KEY"],
                directory=directory,
            )
            # Safety net: do not leave daemons behind if the caller never calls stop().
            atexit.register(rgw.stop)
            return rgw
    _stop_daemons(directory)
    raise RGWUnavailable(f"rgw.sh printed no RGW_ENDPOINT line: {stdout!r}")
