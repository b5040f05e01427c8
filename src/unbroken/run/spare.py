"""Warm spares for ``unbroken run --in-process --warm-spare``: standby processes that have
already imported torch and wait on the supervisor's store for a rank to take over, so a
replacement skips the interpreter start and the imports (seconds, and as much CPU).

Every spare is forked from one template process (`unbroken.run.template`) that made the
imports once. Both sides live here: `Spares`, the supervisor's pool, and the spare's own
side: `main`, the template's process, and `become`, each spare forked from it. The keys
they share are in `unbroken.run.contract`.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import os
import runpy
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

from unbroken.run import contract, listen, template
from unbroken.run.procs import Process, kill_tree
from unbroken.run.template import Forked, Template

FORK_WAIT_S = 120.0  # longest wait for the template's imports before a cold start instead


class Taken(NamedTuple):
    """A spare out of the pool: ``ready`` is False while it still connects."""

    key: str
    proc: Forked
    ready: bool


class Spares:
    """The supervisor's pool of warm spares on its ``store``; each starts with the
    environment ``env()`` returns. Spares taken are replaced later (`replenish`), not at
    once: their template's first imports take CPU the job's start needs."""

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
        self.template: Template | None = None
        self.idle: list[str] = []  # keys asked of the template, forked or not yet
        self.owed = 0  # taken, not replaced yet

    def start(self, count: int = 1) -> None:
        for _ in range(count):
            key = self._ask()
            if key is not None:
                self.idle.append(key)

    def take(self) -> Taken | None:
        """A live spare out of the pool, a ready one first, else one forked now; None if
        the template is gone. While the template still imports this waits for it, which
        is never later than a process started now would be ready."""
        ready = [k for k in self.idle if self.store.check([f"{k}/{contract.SPARE_READY}"])]
        for key in ready + [k for k in self.idle if k not in ready]:
            self.idle.remove(key)
            proc = self._forked(key)
            if proc is not None:
                self.owed += 1
                return Taken(key, proc, ready=key in ready)
        fresh = self._ask()  # the pool is empty: a fork now (not owed: the pool is whole)
        proc = None if fresh is None else self._forked(fresh)
        return None if proc is None or fresh is None else Taken(fresh, proc, ready=False)

    def _ask(self) -> str | None:
        """Ask the template (started with the first spare) for a spare; its key, or None
        if the template is gone."""
        key = f"{contract.SPARE_PREFIX}{uuid.uuid4().hex[:8]}"
        if self.template is None:
            env = self.env()
            if self.script is not None:
                env[contract.SPARE_SCRIPT_ENV] = self.script
            self.template = Template(env)
        return key if self.template.fork(key, self.env()) else None

    def _forked(self, key: str) -> Forked | None:
        assert self.template is not None
        proc = self.template.forked(key, FORK_WAIT_S)
        return proc if proc is not None and proc.poll() is None else None

    def assign(self, key: str, env: dict[str, str], argv: list[str], module: bool) -> None:
        """Make spare ``key`` become a worker: its environment and script."""
        job = json.dumps({"env": env, "argv": argv, "module": module})
        self.store.set(f"{key}/{contract.SPARE_ASSIGN}", job)

    def replenish(self) -> None:
        self.start(self.owed)
        self.owed = 0

    def processes(self) -> list[Process]:
        """The idle spares forked so far, then the template (what to kill at the end)."""
        if self.template is None:
            return []
        forked = [self.template.forked(key, 0.0) for key in self.idle]
        return [p for p in forked if p is not None] + [self.template.proc]

    def stop(self) -> None:
        """End the idle spares (they hold connections to the store) and the template."""
        for proc in self.processes():
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


def prepare(script: str | None) -> None:
    """The template's imports: torch, the library and what the script imports
    (`preload`)."""
    # The point: imported before they are needed (DDP, FSDP and compile import
    # torch._dynamo on first use: ~1 s here).
    import torch._dynamo
    import torch.distributed  # noqa: F401

    import unbroken  # noqa: F401
    from unbroken.run import worker  # noqa: F401

    preload(script)


def become(key: str) -> None:
    """Be warm spare ``key`` (forked from the template, which made the imports): say so
    under ``KEY/ready``, wait for an assignment under ``KEY/assign`` (JSON: ``env`` and
    ``argv``), then become that worker by running its script here."""
    from unbroken.run import worker

    env = os.environ
    assigned = threading.Event()
    threading.Thread(target=_orphaned, args=(os.getppid(), assigned), daemon=True).start()
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


def main() -> None:
    """The template (`unbroken.run.template`): the imports, then a fork per spare. With
    ``--cold KEY``: one spare that makes the imports itself (`_cold`)."""
    if len(sys.argv) == 3 and sys.argv[1] == "--cold":
        prepare(os.environ.pop(contract.SPARE_SCRIPT_ENV, None))
        become(sys.argv[2])
        return
    if len(sys.argv) != 2:
        sys.exit("usage: python -m unbroken.run.spare FD | --cold KEY")
    script = os.environ.pop(contract.SPARE_SCRIPT_ENV, None)
    prepare(script)
    request = template.serve(int(sys.argv[1]))
    if request is not None:  # a forked child
        template.shed(request)
        _cold(request["key"], script)
        become(request["key"])


def _cold(key: str, script: str | None) -> None:
    """If the template's imports initialised CUDA (a library that called
    ``torch.cuda.is_available()`` with ``PYTORCH_NVML_BASED_CUDA_CHECK`` unset, or made a
    tensor there), no fork of it may use CUDA: torch marks such a fork bad. Become a fresh
    interpreter then, the same process for the supervisor, that imports for itself."""
    import torch

    if torch.cuda._is_in_bad_fork():
        if script is not None:
            os.environ[contract.SPARE_SCRIPT_ENV] = script
        cmd = [sys.executable, "-u", "-m", "unbroken.run.spare", "--cold", key]
        os.execv(sys.executable, cmd)


if __name__ == "__main__":
    main()
