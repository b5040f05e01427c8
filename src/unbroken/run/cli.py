"""``unbroken run``: parse the command line, then drive a launch, restart-all
(`unbroken.run.launch`) or in-process (`unbroken.run.supervisor`), to its end.

    unbroken run [unbroken options] [torchrun options] train.py [args]

`loop` is the one poll loop both modes share: the launch's `Watch` looks at the
heartbeat directory, the launch acts on what changed, and a stop (a signal, or a launch
giving up) escalates from the signal to SIGKILL after `STOP_GRACE_S`.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

from unbroken.access import Access
from unbroken.run import args
from unbroken.run.args import RunOptions
from unbroken.run.contract import DEFAULT_MEMORY_ROOT, MEMORY_DIR_ENV
from unbroken.run.nodes import free_finished
from unbroken.run.procs import kill_tree
from unbroken.run.rundir import run_directory
from unbroken.run.timeline import Timeline, say
from unbroken.run.watch import Watch

POLL_S = 0.05
STOP_GRACE_S = 30.0  # after SIGTERM, how long processes get before SIGKILL


class Job(Protocol):
    """What `drive` needs of a launch mode."""

    timeline: Timeline
    watch: Watch
    stopping: bool  # set by stop(): the drive loop escalates after STOP_GRACE_S

    def start(self) -> None: ...

    def poll(self) -> bool:
        """Act on what the watch saw; False once the launch is over."""
        ...

    def live_pids(self) -> list[int]:
        """The processes still running: killed as trees once the grace period is over."""
        ...

    def stop(self, sig: int) -> None: ...

    def exit_code(self) -> int: ...

    def cleanup(self) -> None: ...


def main(argv: list[str]) -> int:
    """`unbroken run ARGV`; the exit code."""
    opts = args.parse(argv)
    if opts.ours.in_process or opts.ours.warm_spare:
        from unbroken.run.supervisor import Supervisor

        targs = args.check_in_process(opts)
        if args.multi_node(opts):
            from unbroken.run.agent import NodeAgent

            return drive(opts, lambda d: NodeAgent(opts, targs, d), "the workers")
        return drive(opts, lambda d: Supervisor(opts, targs, d), "the workers")
    from unbroken.run.launch import RestartAll

    return drive(opts, lambda d: RestartAll(opts, d), "the agents")


def drive(opts: RunOptions, make: Callable[[str], Job], what: str) -> int:
    """Run a launch (``make`` builds it on a fresh heartbeat directory), forwarding
    SIGINT/SIGTERM to ``what`` it started, then print and save its timeline."""
    with run_directory() as heartbeat_dir:  # kept, with the events: unbroken goodput DIR
        job = make(heartbeat_dir)

        def forward(sig: int, frame: FrameType | None) -> None:
            job.timeline.add("signal", f"got signal {sig}: stopping {what}")
            job.stop(sig)

        # Signal handlers can only be set from the main thread (not, say, from a test).
        main_thread = threading.current_thread() is threading.main_thread()
        sigs = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
        old = {s: signal.signal(s, forward) for s in sigs}
        try:
            code = loop(job)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            job.cleanup()
        if code == 0:  # ended normally: no restart will need its snapshots
            free_finished(os.environ.get(MEMORY_DIR_ENV) or DEFAULT_MEMORY_ROOT, heartbeat_dir)
    print(job.timeline.summary(), file=sys.stderr, flush=True)
    say(f"events in {heartbeat_dir}; goodput: unbroken goodput {heartbeat_dir}")
    if opts.ours.timeline_json is not None:  # 0600 whatever the umask, as the event logs
        text = json.dumps(job.timeline.to_json(code), indent=1)
        Access.from_env().write_text(os.fspath(opts.ours.timeline_json), text)
    return code


def loop(job: Job) -> int:
    """Start ``job`` and poll it until it is over; its exit code."""
    job.start()
    # Out of the collector's reach: torch's import-time heap (~170k objects) costs ~90 ms
    # of CPU per full collection, all of it holding the GIL. On a loaded machine that is
    # ~0.5 s in which a node agent's beat and ping threads cannot run: a healthy node lost.
    gc.freeze()
    deadline = None
    while True:
        job.watch.poll()
        if not job.poll():
            break
        if job.stopping:
            deadline = deadline or time.monotonic() + STOP_GRACE_S
            if time.monotonic() > deadline:
                for pid in job.live_pids():
                    kill_tree(pid)
        pause = getattr(job, "pause", time.sleep)  # node agents: woken by the store's news
        pause(POLL_S)
    job.watch.read_events()
    code = job.exit_code()
    job.timeline.add("done", f"done, exit code {code}", exit_code=code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
