"""``unbroken run``, the launcher side of unbroken, and the calls a training script makes
under it.

A training script started by ``unbroken run`` (or plain torchrun) calls:

* `init_process_group(backend="gloo", timeout_s=300.0)` instead of
  ``torch.distributed.init_process_group()``: each restart attempt gets a store of its
  own, so a new attempt never hangs on the dead attempt's addresses;
* `tick(step)` once per step (the Checkpointer also calls it on every ``snapshot`` and
  ``save``): a heartbeat for the launcher's hang watchdog, and the point where injected
  faults fire. Outside ``unbroken run`` it costs a dictionary lookup;
* `event(name, **fields)`, optionally: a line on the launcher's recovery timeline;
* `in_process(train, *, timeout_s=60.0, wait_s=1200.0)` instead of both
  `init_process_group` and a direct call of ``train()``, for in-process recovery
  (``unbroken run --in-process``): ``train()`` runs again in the same process after a
  peer fails. It raises `InProcessError` where that cannot work. Under plain
  ``unbroken run`` or torchrun it initialises the group and calls ``train()`` once.

The worker-side modules (contract, faults, worker) are what the library imports; they
import torch only inside the calls that need it. The modules:

    contract    names shared by launcher and workers: environment, store keys, files
    faults      fault specs (--inject-fault)
    worker      worker side: heartbeats, events, faults, init_process_group
    reached     the last step each process reached, kept through a SIGKILL
    inprocess   worker side of in-process recovery: in_process(train)
    watcher     an in-process rank's abort watcher: the abort, then the next generation
    spare       warm spares (--warm-spare), both sides
    args        the command line: ours, torchrun's, the script's
    procs       process trees: kill_tree, descendants, alive
    timeline    events -> recoveries and the printed summary
    watch       heartbeat watchdog, event reading, kill-node requests (both modes)
    nodes       shared memory: simulated nodes', owners, freeing a finished job's
    launch      restart-all: torchrun agents
    supervisor  in-process: one process per rank, failed ranks replaced alone
    agent       in-process across machines: one node agent per node
    coordinator ``unbroken coordinator``: node slots, node loss, generations
    coordinator_cli  its command line
    etcd        the job's store in etcd: no single point of failure (--etcd)
    cli         main(argv) and the poll loop that drives either mode
    measure     how long process-group initialisation takes
    rundir      the run directory `unbroken run` keeps, and reading its event logs

Entry points: contract, faults, worker, inprocess, procs, rundir, timeline, nodes, cli,
coordinator, coordinator_cli, etcd.
May import: access, errors, job.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.run.inprocess import InProcessError, in_process
    from unbroken.run.worker import event, init_process_group, tick

# Imported on first use (PEP 562): the library reaches `faults` and `contract` through
# this package, and the ``unbroken`` command must not pay for in-process recovery's
# imports (torch) to list a checkpoint.
_WHERE = {
    "InProcessError": "unbroken.run.inprocess",
    "event": "unbroken.run.worker",
    "in_process": "unbroken.run.inprocess",
    "init_process_group": "unbroken.run.worker",
    "tick": "unbroken.run.worker",
}
__all__ = ["InProcessError", "event", "in_process", "init_process_group", "tick"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'unbroken.run' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
