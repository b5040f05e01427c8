"""Warm spares for ``unbroken run --in-process --warm-spare``: standby processes that have
already imported torch and wait on the supervisor's store for a rank to take over, so a
replacement skips the interpreter start and the imports (about 2 s here).

Both sides live here: `Spares`, the supervisor's pool, and `serve`, the spare itself
(``python -m unbroken.run.spare KEY``). The keys they share are in
`unbroken.run.contract`.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

from unbroken.run import contract, listen
from unbroken.run.procs import kill_tree

SpareProcess = tuple[str, subprocess.Popen[bytes]]  # its store key, its process


class Taken(NamedTuple):
    """A spare out of the pool: ``ready`` is False while it still imports."""

    key: str
    proc: subprocess.Popen[bytes]
    ready: bool


class Spares:
    """The supervisor's pool of warm spares on its ``store``; each starts with the
    environment ``env()`` returns. Spares taken are replaced later (`replenish`), not at
    once: a spare importing torch takes CPU the recovery needs."""

    def __init__(
        self,
        store: Any,
        env: Callable[[], dict[str, str]],
        script: tuple[list[str], bool] | None = None,
    ) -> None:
        self.store = store
        self.env = env
        # The worker's script (argv, whether a module): its imports are made in advance.
        self.script = None if script is None else json.dumps([script[0][0], script[1]])
        self.idle: list[SpareProcess] = []
        self.owed = 0  # taken, not replaced yet

    def start(self) -> None:
        key = f"{contract.SPARE_PREFIX}{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-u", "-m", "unbroken.run.spare", key]
        env = self.env()
        if self.script is not None:
            env[contract.SPARE_SCRIPT_ENV] = self.script
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.idle.append((key, proc))

    def take(self) -> Taken | None:
        """A live spare out of the pool, a ready one first; None if none is alive. One
        still importing is taken too: it picks up its assignment once ready, which is
        never later than a process started now would be."""
        live = [(key, proc) for key, proc in self.idle if proc.poll() is None]
        if not live:
            return None
        ready = [s for s in live if self.store.check([f"{s[0]}/{contract.SPARE_READY}"])]
        spare = (ready or live)[0]
        self.idle.remove(spare)
        self.owed += 1
        return Taken(*spare, ready=bool(ready))

    def assign(self, key: str, env: dict[str, str], argv: list[str], module: bool) -> None:
        """Make spare ``key`` become a worker: its environment and script."""
        job = json.dumps({"env": env, "argv": argv, "module": module})
        self.store.set(f"{key}/{contract.SPARE_ASSIGN}", job)

    def replenish(self) -> None:
        for _ in range(self.owed):
            self.start()
        self.owed = 0

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [proc for _, proc in self.idle]

    def stop(self) -> None:
        """End the idle spares (they hold connections to the store)."""
        for _, proc in self.idle:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
        self.idle = []


def preload(script: str | None) -> list[str]:
    """Import what the worker's script imports at its top level (``script``: JSON [path
    or module, is_module]), as its first lines would: a spare that becomes a rank then
    skips those imports too (transformers: seconds). What fails to import is left for the
    script itself to raise. Returns the modules imported."""
    if script is None:
        return []
    name, module = json.loads(script)
    path = name
    if module:
        found = importlib.util.find_spec(name)
        path = found.origin if found is not None else None
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), path)
    if not module:  # run_path puts the script's directory first on sys.path
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    done = []
    for wanted in _imports(tree.body):
        with contextlib.suppress(Exception):
            importlib.import_module(wanted)
            done.append(wanted)
    return done


def _imports(body: list[ast.stmt]) -> list[str]:
    """The absolute imports of a module's top level, those in ``try:`` blocks included
    (``try: import apex``)."""
    names = []
    for node in body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Try):
            names += _imports(node.body)
    return names


def _orphaned(parent: int, assigned: threading.Event) -> None:
    """End this spare at once if its supervisor is gone before it was assigned: the
    main thread is in the store's wait, which only the store would end."""
    while not assigned.wait(0.2):
        if os.getppid() != parent:
            os._exit(0)


def _taken() -> None:
    """Beat for the rank this spare now is, with the time its script's setup may take
    before the first step (`contract.FIRST_STEP_S`, as a cold start has): a spare stopped
    before this line is judged hung a heartbeat timeout after its assignment."""
    folder, rank = os.environ.get(contract.HEARTBEAT_DIR_ENV), os.environ.get("RANK")
    if not folder or rank is None:
        return
    path = os.path.join(folder, contract.heartbeat_file(int(rank)))
    with contextlib.suppress(OSError, ValueError):  # no supervisor's beat: nothing to extend
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            step, _, pid, attempt = contract.heartbeat_fields(
                os.pread(fd, contract.HEARTBEAT_BYTES, 0)
            )
            then = time.time() + contract.FIRST_STEP_S
            os.pwrite(fd, contract.heartbeat_line(step, then, pid, attempt), 0)
        finally:
            os.close(fd)


def serve(key: str) -> None:
    """Be a warm spare: import torch, the library and what the script imports (`preload`),
    say so under ``KEY/ready``, wait for an assignment under ``KEY/assign`` (JSON: ``env``
    and ``argv``), then become that worker by running its script here."""
    # The point: imported before they are needed (DDP, FSDP and compile import
    # torch._dynamo on first use: ~1 s here).
    import torch._dynamo
    import torch.distributed  # noqa: F401

    import unbroken  # noqa: F401
    from unbroken.run import worker

    env = os.environ
    assigned = threading.Event()
    threading.Thread(target=_orphaned, args=(os.getppid(), assigned), daemon=True).start()
    preload(env.pop(contract.SPARE_SCRIPT_ENV, None))
    try:
        store = listen.connect(env["MASTER_ADDR"], int(env["MASTER_PORT"]), 30.0)
        store.set(f"{key}/{contract.SPARE_READY}", str(os.getpid()))
        # One blocking wait, not a poll: idle spares cost the store nothing at scale.
        store.wait([f"{key}/{contract.SPARE_ASSIGN}"], timedelta(days=1))
        job = json.loads(store.get(f"{key}/{contract.SPARE_ASSIGN}"))
        assigned.set()
    except RuntimeError:  # torch's store errors (DistNetworkError among them)
        # The store went away (the job ended, or the coordinator was lost): a spare has
        # nothing to add to what its supervisor or agent says about that.
        sys.exit(0)
    os.environ.update(job["env"])
    worker.reset()
    _taken()
    del store
    sys.argv = list(job["argv"])
    if job.get("module"):
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m unbroken.run.spare KEY")
    serve(sys.argv[1])
