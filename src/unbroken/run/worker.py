"""The worker side of `unbroken run`: heartbeats, timeline events, injected faults, and a
process group that survives restarts.

A training loop calls `tick(step)` once per step (the Checkpointer calls it too). Under
`unbroken run` this does two things:

* it writes a heartbeat for this rank into ``$UNBROKEN_HEARTBEAT_DIR/rank-<RANK>``,
  at most every `HEARTBEAT_INTERVAL_S`, which the launcher's watchdog reads to find hung
  workers long before the collective timeout would;
* it applies the faults in ``$UNBROKEN_INJECT_FAULT`` (`unbroken.run.faults`), on the
  first attempt only, each at most once per launch.

Outside `unbroken run` (no such variables) `tick` costs a dictionary lookup.

Every process also appends events to ``events-<RANK>-<PID>.jsonl`` in the run directory
(``$UNBROKEN_EVENTS_DIR``, else the heartbeat directory, which `unbroken run` keeps as the
run directory): the launcher builds its recovery timeline from them, and `unbroken
goodput` its accounting. Rare events (start, process group ready, restore, fault) are
written at once, one line each, because the launcher acts on them. Frequent ones are
buffered and written together: each step's span (from `tick`), checkpoint saves,
snapshots and background persists (`BUFFERED`), at most one write per `FLUSH_S` and
before any rare event, so the log costs well under a write per step. A kill loses what
is buffered, but not the last step reached (`unbroken.run.reached`). Event names and
fields: docs/goodput.md; file names and variables: `unbroken.run.contract`.

No torch import at module level: `tick` and `event` must stay cheap to import.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from unbroken.access import Access
from unbroken.run import contract, faults, listen, reached
from unbroken.run.faults import Fault, parse

HEARTBEAT_INTERVAL_S = 0.2
FLUSH_S = 1.0  # buffered events wait at most this long (unless the process is killed)
# Events that come often enough to buffer; everything else is written at once.
BUFFERED = frozenset(
    {"save_start", "save_end", "snapshot_start", "snapshot_end", "persist_start", "persist_end"}
)

T = TypeVar("T", bound=type)


class LaunchContext:
    """This process's view of the launch it belongs to, read from the environment once:
    its rank and attempt, the heartbeat directory, and the faults it is to fire."""

    def __init__(self) -> None:
        env = os.environ
        self.rank = int(env.get("RANK", "0"))
        self.attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        node = env.get(contract.NODE_ENV, "")
        self.node = int(node) if node.isdigit() else None
        self.dir = env.get(contract.HEARTBEAT_DIR_ENV) or None
        faults = parse(env.get(contract.FAULT_ENV, ""))
        # Faults fire on the first attempt only: the restarted workers must get through.
        # Crash faults fire at their crash points (`unbroken.run.faults.point`), not here.
        mine = [f for f in faults if f.kind != "crash" and self._mine(f)]
        self.faults = mine if self.attempt == 0 else []
        if self.dir is None and any(f.kind == "kill-node" for f in self.faults):
            raise RuntimeError(
                f"{contract.FAULT_ENV} asks for kill-node, which only `unbroken run "
                f"--simulate-nodes` can carry out ({contract.HEARTBEAT_DIR_ENV} is not set)"
            )
        events_dir = env.get(contract.EVENTS_DIR_ENV) or self.dir
        # normalised: "ckpt/../events" must not need ckpt to exist yet
        self.events_dir = os.path.abspath(events_dir) if events_dir else None
        self.reached = reached.Reached(self.events_dir, self.rank)  # survives a SIGKILL
        self.fd: int | None = None
        self.last_beat = float("-inf")
        self.beat_step = 0  # the step of the last heartbeat
        self.first_step_seen = False
        self.started = False
        self.lock = threading.Lock()  # background persists log from the save thread
        self.buffer: list[tuple[float, str]] = []  # buffered events: (t, JSON line)
        self.spans: list[tuple[int, float, float]] = []  # (step, start, end), wall clock
        self.last_step: int | None = None
        self.mark = time.time()  # when the step now running started: the last event or tick
        self.last_flush = time.monotonic()
        self.exit_hook = False

    def _mine(self, fault: Fault) -> bool:
        if fault.kind == "kill-node":
            return fault.target == self.node
        return fault.target == self.rank

    # events: rare ones written whole at once, frequent ones buffered (see the docstring)

    def event(self, name: str, **fields: Any) -> None:
        if self.events_dir is None:
            return
        with self.lock:
            self._start()
            record = self._record(name, fields)
            if not name.startswith("persist"):  # a background persist is no step boundary
                self.mark = record["t"]
            self.buffer.append((record["t"], json.dumps(record)))
            if name in BUFFERED:
                self._hook_exit()
                return
            self._flush()

    def _record(self, name: str, fields: dict[str, Any]) -> dict[str, Any]:
        record = {"event": name, "t": time.time(), "rank": self.rank, "attempt": self.attempt}
        record.update(node=self.node, pid=os.getpid(), **fields)
        return record

    def _start(self) -> None:
        """This process's first event: when it started."""
        if not self.started:
            self.started = True
            start = self._record("process_start", {"process_start": _process_start_time()})
            self.buffer.append((start["t"], json.dumps(start)))

    def _hook_exit(self) -> None:
        if not self.exit_hook:
            self.exit_hook = True
            atexit.register(self.flush)

    def flush(self) -> None:
        """Write what is buffered, in one write."""
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        if self.spans:
            # Formatted by hand: a third of json.dumps's cost, for what may be many spans.
            spans = ",".join([f"[{s},{a:.6f},{b:.6f}]" for s, a, b in self.spans])
            head = json.dumps(self._record("steps", {}))[:-1]
            self.buffer.append((self.spans[-1][2], f'{head}, "spans": [{spans}]}}'))
            self.spans = []
        self.last_flush = time.monotonic()
        if not self.buffer or self.events_dir is None:
            return
        self.buffer.sort(key=lambda r: r[0])  # in time order, the steps among the rest
        data = "".join(line + "\n" for _, line in self.buffer).encode()
        self.buffer = []
        path = os.path.join(self.events_dir, contract.events_file(self.rank, os.getpid()))
        access = Access.from_env()
        access.makedirs(self.events_dir)
        fd = access.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def span(self, step: int) -> None:
        """Note that ``step`` ended now (a tick of a new step): its span runs from the
        previous tick or event to now. Buffered; flushed at most every `FLUSH_S`."""
        now = time.time()
        with self.lock:
            if not self.started:
                self._start()
            self.spans.append((step, self.mark, now))
            self.reached.note(step, now, self.attempt)
            self.mark = now
            self.last_step = step
            if len(self.spans) == 1:
                self._hook_exit()
            if time.monotonic() - self.last_flush >= FLUSH_S:
                self._flush()

    # heartbeat: one pwrite of a fixed-width line into a file kept open

    def beat(self, step: int, now: float) -> None:
        assert self.dir is not None
        if self.fd is None:
            path = os.path.join(self.dir, contract.heartbeat_file(self.rank))
            self.fd = Access.from_env().open(path, os.O_WRONLY)
        os.pwrite(self.fd, contract.heartbeat_line(step, time.time(), os.getpid(), self.attempt), 0)
        self.last_beat, self.beat_step = now, step

    def tick(self, step: int) -> None:
        if self.events_dir is not None and step != self.last_step:
            self.span(step)
        if self.dir is not None:
            now = time.monotonic()
            if not self.first_step_seen:
                self.first_step_seen = True
                self.event("first_step", step=step)
                self.beat(step, now)
            elif now - self.last_beat >= HEARTBEAT_INTERVAL_S:
                self.beat(step, now)
        for fault in list(self.faults):
            if step >= fault.step:
                self.fire(fault, step)

    def fire(self, fault: Fault, step: int) -> None:
        if not self._claim(fault):
            self.faults.remove(fault)  # fired already in this launch (a replacement node)
            return
        self.event("fault", kind=fault.kind, spec=str(fault), step=step)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "kill-node":
            # The launcher owns the node: it kills this node's agent and workers and
            # deletes the node's shared memory. Until then, this rank stops where it is.
            assert self.dir is not None
            tmp = os.path.join(self.dir, f".request-{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(json.dumps({"node": fault.target, "step": step, "t": time.time()}))
            os.replace(tmp, os.path.join(self.dir, contract.kill_node_file(fault.target)))
        while True:  # hang (or wait to be killed): no more steps, no more heartbeats
            time.sleep(3600)

    def _claim(self, fault: Fault) -> bool:
        """True once per launch for each fault, across attempts and replacement nodes."""
        if self.dir is None:
            return True
        path = os.path.join(self.dir, contract.fired_file(fault.index))
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True


_context: LaunchContext | None = None


def current() -> LaunchContext:
    """This process's launch context, read from the environment on first use."""
    global _context
    if _context is None:
        _context = LaunchContext()
    return _context


def tick(step: int) -> None:
    """Report that training reached ``step``: heartbeat, and injected faults.

    Call it once per step; calling it more often (the Checkpointer does) is harmless.
    It costs about a microsecond: a clock read, and a small write at most every
    `HEARTBEAT_INTERVAL_S`."""
    current().tick(step)


def event(name: str, **fields: Any) -> None:
    """Record a timeline event for `unbroken run` and `unbroken goodput` (nothing happens
    outside `unbroken run`, unless ``$UNBROKEN_EVENTS_DIR`` is set). Names in `BUFFERED`
    are written with the next flush; others at once. ``data_ready`` (optional field
    ``seconds``: how long the pipeline took to deliver its first batch) marks the end of
    the data pipeline's warm-up, which `unbroken goodput` counts as badput."""
    current().event(name, **fields)


def _before_crash(point: str, hit: int) -> None:
    ctx = current()
    spec = f"crash point={point} rank={ctx.rank} hit={hit}"
    event("fault", kind="crash", spec=spec, step=ctx.last_step, point=point, hit=hit)
    flush()


faults.BEFORE_CRASH.append(_before_crash)  # a crash point records the fault, then kills


def flush() -> None:
    """Write the buffered events now (they are also written at exit, and before a
    process kills itself for an injected fault)."""
    current().flush()


def instrument(cls: T) -> T:
    """Time a Checkpointer class's ``save`` and ``snapshot`` (training waits for them) and
    ``_persist`` (its save thread writing a checkpoint) in the event log, as
    ``<name>_start`` and ``<name>_end`` events, and its ``close`` as ``closing`` (the
    launcher's watchdog leaves a process alone from then until its next tick, so a slow
    shutdown is not taken for a hang): `Checkpointer` is decorated with it, so its
    methods carry no event-log code. A save or snapshot ticks its
    step first, so the step it follows ends where the save begins."""
    timed: dict[str, Callable[..., dict[str, Any]]] = {
        "save": lambda step, state, blocking=True, **_: {"step": step, "blocking": blocking},
        "snapshot": lambda step, state: {"step": step},
        "_persist": lambda staged, background: {"step": staged.step, "background": background},
    }
    for name, fields in timed.items():
        setattr(cls, name, _timed(name.lstrip("_"), getattr(cls, name), fields))
    close = cls.close  # type: ignore[attr-defined]

    @functools.wraps(close)
    def closing(self: Any) -> None:
        # Training is over unless a tick follows: the watchdog leaves a shutdown alone.
        event("closing")
        close(self)

    cls.close = closing  # type: ignore[attr-defined]
    return cls


def _timed(name: str, method: Callable[..., Any], fields: Callable[..., dict[str, Any]]) -> Any:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        info = fields(*args, **kwargs)
        step = info["step"]
        if name != "persist" and isinstance(step, int) and step >= 0:
            tick(step)
        event(f"{name}_start", **info)
        try:
            return method(self, *args, **kwargs)
        finally:
            event(f"{name}_end", step=step)

    return run


def new_attempt(attempt: int) -> None:
    """Start a new attempt in this same process (in-process recovery): events and
    heartbeats carry ``attempt`` from now on, and its first step is reported again."""
    context = current()
    context.flush()
    context.attempt = attempt
    context.first_step_seen = False
    context.last_step = None


def reset() -> None:
    """Forget what was read from the environment (a warm spare taking on a rank's
    environment, or a test changing it)."""
    global _context
    if _context is not None:
        _context.flush()
        if _context.fd is not None:
            with contextlib.suppress(OSError):
                os.close(_context.fd)
    _context = None


def _process_start_time() -> float | None:
    """When this process started (wall clock), from /proc: it includes the interpreter
    and import time that a restart costs, which the process itself cannot time."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


# -- process group ----------------------------------------------------------------------


def init_process_group(backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """`torch.distributed.init_process_group` for a worker started by torchrun, such that
    a restarted attempt never meets the previous attempt's keys.

    gloo ranks exchange their addresses through the store. If the store outlives an
    attempt (torchrun shares its agent's store with the workers, across restarts), a
    restarted rank could read a dead rank's address and hang; so each attempt gets its
    own key prefix, ``unbroken/attempt-<TORCHELASTIC_RESTART_COUNT>``. When the store is
    hosted by worker rank 0 (`unbroken run` asks torchrun for that, with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), it is new for each attempt and no prefix is
    needed, which also holds when a replacement node's agent counts its restarts from 0.
    """
    import torch.distributed as dist

    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise RuntimeError(
            f"init_process_group needs torchrun's environment; {', '.join(missing)} not set. "
            "Start the script with torchrun or `unbroken run`."
        )
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    context = current()
    context.event("init_start")
    timeout = timedelta(seconds=timeout_s)
    if not shared and rank == 0:  # on MASTER_ADDR only, not on every interface
        store = listen.host_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, timeout_s)
    else:
        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            world_size=world,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=True,  # the Checkpointer's groups may reuse the server in-process
        )
    prefix = f"{contract.ATTEMPT_PREFIX}{attempt}" if shared else "unbroken"
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, timeout=timeout
    )
    context.event("init_done", prefix=prefix)
