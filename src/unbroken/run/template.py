"""The warm spares' template: one process per supervisor (or node agent) that imports
torch, the library and the worker script's imports once, then forks every spare from
itself. A spare then costs a fork (tens of milliseconds, its pages shared copy-on-write)
instead of an interpreter and the imports: about 3.5 s of CPU with transformers, taken
from the cores the ranks train on, for every spare started after every fault.

Both sides live here: `Template`, the parent's handle (ask for a fork, learn each forked
process's exit status, which only the template, its parent, can read), and `serve`, the
template's loop (run by ``python -m unbroken.run.spare FD``, which makes the imports
first and then becomes the spare in each forked child).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from unbroken.run.procs import alive

LOST = -signal.SIGKILL  # the status of a forked process whose template ended before it


class Forked:
    """A process the template forked, with what the supervisor uses of `subprocess.Popen`
    (``pid``, ``poll``, ``wait``, ``returncode``)."""

    def __init__(self, pid: int, template: Template) -> None:
        self.pid = pid
        self.template = template
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.template.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            with self.template.changed:  # a report wakes it; a lost template needs a look
                self.template.changed.wait(0.05 if self.template.ended else 1.0)
        return code


class Template:
    """Start the template with environment ``env`` (its imports see it) and read its
    reports: which pid each fork got, and how each forked process ended."""

    def __init__(self, env: dict[str, str]) -> None:
        read, write = os.pipe()
        cmd = [sys.executable, "-u", "-m", "unbroken.run.spare", str(write)]
        # torch.cuda.is_available() by NVML, which leaves the forks free to use CUDA.
        env = {**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, pass_fds=(write,), start_new_session=True
        )
        os.close(write)
        self.changed = threading.Condition()
        self.pids: dict[str, int] = {}  # spare key -> pid, once forked
        self.codes: dict[int, int] = {}  # pid -> exit status, as `Popen.returncode`
        self.ended = False
        reader = threading.Thread(target=self._read, args=(read,), daemon=True)
        reader.start()

    def fork(self, key: str, env: dict[str, str]) -> bool:
        """Ask for spare ``key`` with environment ``env``; False if the template is gone."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"key": key, "env": env}).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return False
        return True

    def forked(self, key: str, timeout: float) -> Forked | None:
        """Spare ``key``'s process, waiting up to ``timeout`` for its fork (the template
        may still be importing); None if it was not forked in that time."""
        with self.changed:
            self.changed.wait_for(lambda: key in self.pids or self.ended, timeout)
            pid = self.pids.get(key)
        return None if pid is None else Forked(pid, self)

    def status(self, pid: int) -> int | None:
        with self.changed:
            if pid in self.codes:
                return self.codes[pid]
            lost = self.ended
        return LOST if lost and not alive(pid) else None

    def stop(self) -> None:
        """End the template: its idle spares then end too (`spare._orphaned`); the ranks
        it forked run on."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as reports:
            for line in reports:
                what, name, value = line.split()
                with self.changed:
                    if what == b"forked":
                        self.pids[name.decode()] = int(value)
                    else:
                        self.codes[int(name)] = int(value)
                    self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()


def serve(report: int) -> dict[str, Any] | None:
    """Be the template: fork a spare for each request on stdin (a JSON line: ``key`` and
    ``env``) and report on fd ``report`` ``forked KEY PID`` and ``exited PID STATUS``.
    Returns the request in the forked child, None in the template once stdin ends."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake fd hears it
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for ready, _ in sel.select():
            if ready.fd == wake_r:
                os.read(wake_r, 4096)
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return None
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:  # the spare: none of the template's signal handling
                    os.setsid()  # first, so killing its group never kills the template
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for fd in (report, wake_r, wake_w):
                        os.close(fd)
                    return dict(request)
                os.write(report, f"forked {request['key']} {pid}\n".encode())
        _reap(report)


def _reap(report: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(report, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def shed(request: dict[str, Any]) -> None:
    """In a forked child (already in a session of its own): shed the template's input,
    take the spare's own environment (then `unbroken.run.spare.become` makes it the spare)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # its global generator was seeded once, in the template
        numpy.random.seed()
