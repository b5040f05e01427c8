"""The contract between `unbroken run` and its workers: every environment variable, store
key and heartbeat-directory file name that both sides use, in one place.

The launcher (`unbroken.run.launch`, `unbroken.run.supervisor`) writes these; the worker
side (`unbroken.run.worker`, `unbroken.run.inprocess`, `unbroken.run.spare`, and the
Checkpointer) reads them. Neither side spells a name itself.
"""

from __future__ import annotations

import os

# -- environment variables (launcher -> worker) -----------------------------------------

HEARTBEAT_DIR_ENV = "UNBROKEN_HEARTBEAT_DIR"  # where heartbeats, events and requests go
FAULT_ENV = "UNBROKEN_INJECT_FAULT"  # ';'-separated fault specs (`unbroken.run.faults`)
NODE_ENV = "UNBROKEN_NODE"  # the simulated node a worker runs on
MEMORY_DIR_ENV = "UNBROKEN_MEMORY_DIR"  # root of the node's shared-memory snapshots
IN_PROCESS_ENV = "UNBROKEN_IN_PROCESS"  # "1" when the in-process supervisor started it
EVENTS_DIR_ENV = "UNBROKEN_EVENTS_DIR"  # where events go, if not the heartbeat directory
RUN_DIR_ENV = "UNBROKEN_RUN_DIR"  # `unbroken run`: the run directory to use (new or empty)
# Across machines: the coordinator's address as the user gave it, for messages (a node's
# MASTER_ADDR:MASTER_PORT is its loopback relay to the coordinator, `unbroken.run.gate`).
COORDINATOR_ENV = "UNBROKEN_COORDINATOR"
# Across machines: the node agent that started the rank, which holds its node's slot
# (``unbroken/slot-<node>/owner``) for as long as the coordinator counts the node in.
AGENT_ENV = "UNBROKEN_AGENT"

# -- shared memory ----------------------------------------------------------------------

# Each user's own (0700), never one shared folder: whoever owns a folder can swap what is
# in it, sticky bit or not.
DEFAULT_MEMORY_ROOT = f"/dev/shm/unbroken-{os.geteuid()}"  # where MEMORY_DIR_ENV is not set
SIM_MEMORY_ROOT = f"/dev/shm/unbroken-sim-{os.geteuid()}"  # simulated nodes: <job>/node-<i>

OWNER_PREFIX = "owner-"  # owner-<rank> in a job's memory folder: "<pid> <pid namespace>@<host>"

# -- store keys (the launcher's TCPStore, read by workers) ------------------------------

GENERATION_KEY = "unbroken/generation"  # in-process recovery: the running generation
ABORT_KEY = "unbroken/abort"  # -<g>: set by the supervisor when generation g failed
STARTED_KEY = "unbroken/started"  # -<g>: set by the supervisor once generation g started
GENERATION_PREFIX = "unbroken/gen-"  # +<g>: the store prefix of generation g's group
ATTEMPT_PREFIX = "unbroken/attempt-"  # +<n>: restart attempt n's prefix in a shared store
SPARE_PREFIX = "unbroken/spare-"  # +<id>: a warm spare's keys, below
SPARE_READY = "ready"  # <spare key>/ready: the spare imported torch and waits
SPARE_ASSIGN = "assign"  # <spare key>/assign: JSON {env, argv, module}: become this rank
# A warm spare's environment: JSON [script or module, is_module]: the script whose own
# imports the spare makes before it says it is ready.
SPARE_SCRIPT_ENV = "UNBROKEN_SPARE_SCRIPT"

# -- the coordinator's store (multi-node in-process: `unbroken.run.coordinator`) --------

JOB_KEY = "unbroken/job"  # JSON {nnodes, nproc_per_node}: the first agent sets it
SLOT_PREFIX = "unbroken/slot-"  # +<node>/owner: the agent id holding node slot <node>
AGENT_PREFIX = "unbroken/agent-"  # +<id>/beat: a counter the agent bumps, its heartbeat
DONE_SUFFIX = "done"  # <slot key>/done: the node's ranks all finished training
SPAWN_KEY = "spawn"  # unbroken/gen-<g>/spawn-<agent id>: JSON ranks to start for g
SETTLED_KEY = "settled"  # unbroken/gen-<g>/settled-<agent id>: JSON ranks the node lost
MEMBERS_KEY = "unbroken/members"  # -<g>: JSON {slot: agent id} once g's orders are all set
SUSPECT_KEY = "unbroken/suspect"  # -<g>: "<rank>," per worker that saw a peer vanish in g
PING_SUFFIX = "ping"  # unbroken/agent-<id>/ping: a counter; /ping-<n>: beat now, please
# A counter of the agents waiting for a node slot (standbys): a coordinator told to exit
# when the job is done waits for them to see it first, so none finds the store gone.
STANDBY_KEY = "unbroken/standby"

# -- files in the heartbeat directory (the run directory under `unbroken run`) ----------

HEARTBEAT_PREFIX = "rank-"  # rank-<rank>: one fixed-width heartbeat line, rewritten
HEARTBEAT_BYTES = 80  # the heartbeat line's width: rewritten in place, never truncated
# How long past the heartbeat timeout a rank has from its start to its first step: its
# imports and the script's setup (model, data, compile), which a warm spare runs too.
FIRST_STEP_S = 300.0
EVENTS_PREFIX = "events-"  # events-<rank>-<pid>.jsonl: one JSON line per event
LAUNCHER_EVENTS = "launcher.jsonl"  # the launcher's own events (detections, restarts)
REACHED_PREFIX = "reached-"  # reached-<rank>-<pid>: its last step, mapped (`run.reached`)
FIRED_PREFIX = "fired-"  # fired-<index>: fault <index> fired already in this launch
KILL_NODE_PREFIX = "request-kill-node-"  # request-kill-node-<node>: a worker asks


def owner_text(pid: int) -> str:
    """What a rank writes in its ``owner-<rank>`` file: its pid, and the pid namespace and
    host that number means something in (containers may share ``/dev/shm``)."""
    return f"{pid} {_namespace()}"


def owner_pid(text: str) -> int | None:
    """The pid an owner file names, if it is one of this pid namespace and host."""
    pid, _, where = text.partition(" ")
    try:
        return int(pid) if where.strip() == _namespace() else None
    except ValueError:
        return None


def _namespace() -> str:
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "pid:?"
    return f"{ns}@{os.uname().nodename}"


def heartbeat_file(rank: int) -> str:
    return f"{HEARTBEAT_PREFIX}{rank}"


def heartbeat_line(step: int, t: float, pid: int, attempt: int) -> bytes:
    """A heartbeat: ``rank-<rank>``'s one line, fixed width, rewritten in place."""
    line = f"{step} {t:.6f} {pid} {attempt}"
    return line.ljust(HEARTBEAT_BYTES - 1).encode() + b"\n"


def heartbeat_fields(line: bytes) -> tuple[int, float, int, int]:
    """A `heartbeat_line`'s step, time, pid and attempt; ValueError if it is not one."""
    step, t, pid, attempt = line.split()
    return int(step), float(t), int(pid), int(attempt)


def events_file(rank: int, pid: int) -> str:
    return f"{EVENTS_PREFIX}{rank}-{pid}.jsonl"


def reached_file(rank: int, pid: int) -> str:
    return f"{REACHED_PREFIX}{rank}-{pid}"


def fired_file(index: int) -> str:
    return f"{FIRED_PREFIX}{index}"


def kill_node_file(node: int) -> str:
    return f"{KILL_NODE_PREFIX}{node}"


def slot_key(node: int, what: str) -> str:
    return f"{SLOT_PREFIX}{node}/{what}"


def agent_beat_key(agent: str) -> str:
    return f"{AGENT_PREFIX}{agent}/beat"


def generation_key(generation: int, what: str, agent: str) -> str:
    return f"{GENERATION_PREFIX}{generation}/{what}-{agent}"


def worker_env(heartbeat_dir: str, faults: str) -> dict[str, str]:
    """The environment every worker of a launch starts with: this process's, plus the
    heartbeat directory and the faults to inject."""
    env = dict(os.environ)
    env[HEARTBEAT_DIR_ENV] = heartbeat_dir
    env[FAULT_ENV] = faults
    # Worker rank 0 hosts a fresh store for each attempt instead of the agent sharing
    # one across attempts: no stale keys, no store dying with a killed agent, and no
    # reliance on restart counts, which differ on a replacement node.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env
