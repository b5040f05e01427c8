"""The command line of ``unbroken run``: which options are ours, which torchrun's, which
the script's, and the checks that refuse a launch that cannot work, before anything
starts.

    unbroken run [unbroken options] [torchrun options] train.py [args]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from unbroken.run import faults as fault_specs
from unbroken.run.faults import Fault
from unbroken.run.listen import is_etcd

# Options of ours that torchrun must not also get (the simulated nodes set them).
SIMULATION_SETS = (
    "--nnodes",
    "--node-rank",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--standalone",
    "--master-addr",
    "--master-port",
    "--local-addr",
)
# torchrun options that make sense on one machine; anything else is multi-machine or
# elastic membership, which in-process mode does not do.
IN_PROCESS_ALLOWED = {
    "--nproc-per-node",
    "--nproc_per_node",
    "--max-restarts",
    "--max_restarts",
    "--monitor-interval",
    "--monitor_interval",
    "--standalone",
    "--nnodes",
    "--run-id",
    "--run_id",
    "--rdzv-id",
    "--rdzv_id",
    "-m",
    "--module",
    "--no-python",
    "--no_python",
}
# Multi-node in-process (`unbroken.run.agent`): where the coordinator is, which node this is.
MULTI_NODE_ALLOWED = {
    "--node-rank",
    "--node_rank",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-backend",
    "--rdzv_backend",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
}
_TAKES_VALUE = {
    "--inject-fault",
    "--heartbeat-timeout",
    "--hang-factor",
    "--simulate-nodes",
    "--timeline-json",
    "--secret-file",
}
_FLAGS = {"--in-process", "--warm-spare"}


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """A checked ``unbroken run`` command line (`parse` makes one)."""

    ours: argparse.Namespace  # our options, parsed
    torchrun_opts: list[str]  # torchrun's, as given
    script: list[str]  # the script and its arguments
    faults: list[Fault]
    max_restarts: int
    nproc_per_node: int | None  # None: not a number (torchrun's "auto", "gpu", ...)


def _our_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unbroken run",
        usage="unbroken run [unbroken options] [torchrun options] train.py [args]",
        description="torchrun with a hang watchdog, fault injection, simulated nodes and a "
        "recovery timeline. Every other option goes to torchrun unchanged.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="'kill rank=R step=S', 'hang rank=R step=S' or 'kill-node node=N step=S'; "
        "repeatable or ';'-separated. Needs --max-restarts 1 or more.",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="SIGKILL a worker that has not called unbroken.run.tick() for this long "
        "(after its first tick), so torchrun restarts the workers (default 60; 0: off)",
    )
    hang = "a rank is hung after F times its longest gap between heartbeats in this generation"
    p.add_argument("--hang-factor", type=float, default=0.0, metavar="F", help=f"{hang}, once "
                   "learned (at least 2 s, at most --heartbeat-timeout; 0: off)")  # fmt: skip
    p.add_argument(
        "--simulate-nodes",
        type=int,
        metavar="N",
        help="run N torchrun agents on this machine, each a node with its own shared memory",
    )
    p.add_argument("--timeline-json", type=Path, metavar="PATH", help="write the timeline here")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="replace only failed ranks, keeping the healthy ones alive (the script calls "
        "unbroken.run.in_process); across machines, one per node with --nnodes, "
        "--node-rank and --rdzv-endpoint of an `unbroken coordinator`",
    )
    p.add_argument(
        "--warm-spare",
        action="store_true",
        help="with --in-process: keep a standby worker per node with torch and the "
        "script's own imports made (a node agent without --node-rank, a standby node, "
        "keeps one per local rank)",
    )
    p.add_argument(
        "--secret-file",
        metavar="PATH",
        help="across machines: the job's shared secret, as the coordinator's (default: "
        "$UNBROKEN_JOB_SECRET); the node talks to the coordinator through its gate",
    )
    return p


def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def split_argv(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Split into (unbroken options, torchrun options, [script, *its args]).

    Ours may come anywhere before the script; anything after the script is the
    script's. Which torchrun options take a value is read from torchrun's own parser."""
    theirs: dict[str, bool] = {}
    for action in torchrun_parser()._actions:
        for opt in action.option_strings:
            theirs[opt] = action.nargs != 0
    ours: list[str] = []
    torchrun: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg == "--":
            return ours, torchrun, argv[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            return ours, torchrun, argv[i:]
        target = ours if name in _TAKES_VALUE or name in _FLAGS else torchrun
        target.append(arg)
        takes_value = name in _TAKES_VALUE or (name not in _FLAGS and theirs.get(name, True))
        if "=" not in arg and takes_value and i + 1 < len(argv) and name not in ("-h", "--help"):
            target.append(argv[i + 1])
            i += 1
        i += 1
    return ours, torchrun, []


def parse(argv: list[str]) -> RunOptions:
    """Parse and check the command line; raises SystemExit(2) with a message if wrong."""
    ours_argv, torchrun_opts, script = split_argv(argv)
    parser = _our_parser()
    if not script and not ours_argv and any(a in ("-h", "--help") for a in torchrun_opts):
        parser.print_help()
        print("\ntorchrun options:")
        torchrun_parser().print_help()
        raise SystemExit(0)
    ours = parser.parse_args(ours_argv)
    if not script:
        parser.error("no training script given: unbroken run [options] train.py [args]")
    targs = torchrun_parser().parse_args([*torchrun_opts, *script])
    try:
        faults = fault_specs.parse(";".join(ours.inject_fault))
    except ValueError as e:
        parser.error(str(e))
    nproc = int(targs.nproc_per_node) if str(targs.nproc_per_node).isdigit() else None
    if faults and targs.max_restarts < 1:
        parser.error(
            f"--inject-fault needs --max-restarts 1 or more (got {targs.max_restarts}): "
            "otherwise the first fault ends the job"
        )
    if ours.heartbeat_timeout < 0:
        parser.error("--heartbeat-timeout must be positive (or 0 to turn the watchdog off)")
    if ours.hang_factor and (ours.hang_factor < 1 or not ours.heartbeat_timeout):
        parser.error(
            f"--hang-factor {ours.hang_factor:g}: must be 1 or more (0: off), with a "
            "--heartbeat-timeout above 0 as its ceiling"
        )
    if ours.simulate_nodes is not None:
        _check_simulation(parser, ours.simulate_nodes, torchrun_opts, targs)
    nnodes = _int(str(targs.nnodes).split(":")[-1])
    multi = nnodes if nnodes is not None and nnodes > 1 else None
    _check_targets(parser, faults, ours.simulate_nodes or multi, nproc, targs)
    problem = script_problem(script[0], module=targs.module, no_python=targs.no_python)
    problem = problem or output_problem(ours.timeline_json)
    if problem:
        print(f"unbroken run: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return RunOptions(
        ours=ours,
        torchrun_opts=torchrun_opts,
        script=script,
        faults=faults,
        max_restarts=targs.max_restarts,
        nproc_per_node=nproc,
    )


def _check_simulation(
    parser: argparse.ArgumentParser,
    nodes: int,
    torchrun_opts: list[str],
    targs: argparse.Namespace,
) -> None:
    if nodes < 1:
        parser.error(f"--simulate-nodes {nodes}: simulate at least one node")
    given = [
        o
        for o in torchrun_opts
        if o.split("=", 1)[0].replace("_", "-") in SIMULATION_SETS
        and not (o.startswith("--nnodes") and targs.nnodes == str(nodes))
    ]
    if given:
        parser.error(
            f"--simulate-nodes sets {', '.join(sorted(set(given)))} itself; leave them out"
        )
    if targs.max_restarts < 1:
        parser.error("--simulate-nodes needs --max-restarts 1 or more to recover a node")


def _check_targets(
    parser: argparse.ArgumentParser,
    faults: list[Fault],
    nodes: int | None,
    nproc: int | None,
    targs: argparse.Namespace,
) -> None:
    """Every fault names a node or rank that the job has."""
    for f in faults:
        if f.kind == "kill-node":
            if nodes is None:
                parser.error(f"{str(f)!r} needs --simulate-nodes or --nnodes")
            elif f.target >= nodes:
                parser.error(f"{str(f)!r}: there are only nodes 0..{nodes - 1}")
        elif nproc is not None and f.target >= nproc * (nodes or 1):
            parser.error(f"{str(f)!r}: no such rank in this job")


def script_problem(script: str, *, module: bool, no_python: bool) -> str | None:
    """Why torchrun could not start ``script`` (None if it can): checked here, so a typo
    is one line and exit code 2, not a failed launch and a ChildFailedError traceback."""
    if module:
        if not _importable(script):
            return f"-m {script}: no module of that name can be imported from here"
        return None
    if no_python:
        if shutil.which(script) is None:
            return f"{script}: no such executable (--no-python runs it as a program)"
        return None
    path = Path(script)
    if path.is_dir():
        return f"{script} is a directory; give the training script (a .py file) inside it"
    if not path.is_file():
        return f"{script}: no such file (relative to {Path.cwd()}); check the script's path"
    return None


def output_problem(path: Path | None) -> str | None:
    """Why ``--timeline-json PATH`` could not be written at the job's end (None if it
    can): checked before training starts, not found out after it ends."""
    if path is None:
        return None
    folder = path.absolute().parent
    if path.is_symlink():  # unbroken writes through no link (`unbroken.access`)
        return f"--timeline-json {path} is a symbolic link; give the path of a file to write"
    if path.is_dir():
        return f"--timeline-json {path} is a directory; give the path of a file to write"
    if not folder.is_dir():
        return f"--timeline-json {path}: the folder {folder} does not exist; create it first"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"--timeline-json {path}: the folder {folder} is not writable"
    return None


def _importable(module: str) -> bool:
    """Whether ``python -m module`` finds it, as a worker would: from the current directory
    (which `python -m` puts first on sys.path) or the usual path."""
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a bad name
        return False
    finally:
        sys.path.pop(0)


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def endpoint(targs: argparse.Namespace) -> tuple[str, int]:
    """The coordinator's address: ``--rdzv-endpoint`` (an ``etcd://`` URL as is, port 0),
    else ``--master-addr/--master-port``."""
    if targs.rdzv_endpoint and is_etcd(targs.rdzv_endpoint):
        return targs.rdzv_endpoint, 0  # the job's etcd cluster (`unbroken.run.etcd`)
    if targs.rdzv_endpoint:
        host, _, port = targs.rdzv_endpoint.rpartition(":")
        return (host or targs.rdzv_endpoint), int(port or 29400)
    return targs.master_addr, int(targs.master_port or 29400)


def multi_node(opts: RunOptions) -> bool:
    """Whether an in-process launch is one node agent of a multi-node job: it names a
    coordinator (``--rdzv-endpoint`` or ``--master-addr``) and is not a simulation."""
    given = {o.split("=", 1)[0].replace("_", "-") for o in opts.torchrun_opts}
    return opts.ours.simulate_nodes is None and bool(given & {"--rdzv-endpoint", "--master-addr"})


def check_in_process(opts: RunOptions) -> argparse.Namespace:
    """Refuse what in-process mode cannot do; torchrun's parsed options."""
    parser = argparse.ArgumentParser(prog="unbroken run --in-process")
    targs = torchrun_parser().parse_args([*opts.torchrun_opts, *opts.script])
    given = {o.split("=", 1)[0] for o in opts.torchrun_opts if o.startswith("-")}
    allowed = IN_PROCESS_ALLOWED | (MULTI_NODE_ALLOWED if multi_node(opts) else set())
    others = sorted(given - allowed)
    if others:
        parser.error(
            f"{', '.join(others)}: not with --in-process, which takes --nnodes, "
            "--node-rank and --rdzv-endpoint (the `unbroken coordinator`) across machines"
        )
    nodes = opts.ours.simulate_nodes
    one = targs.nnodes in ("1", "1:1") or (nodes and targs.nnodes == str(nodes))
    if not one and not multi_node(opts):
        parser.error(
            f"--nnodes={targs.nnodes}: a multi-node --in-process job needs "
            "--rdzv-endpoint HOST:PORT of an `unbroken coordinator`"
        )
    if multi_node(opts) and not str(targs.nnodes).split(":")[-1].isdigit():
        parser.error(f"--nnodes={targs.nnodes}: --in-process needs a fixed node count")
    if opts.nproc_per_node is None:
        parser.error("--in-process needs --nproc-per-node as a number")
    if opts.ours.warm_spare and not opts.ours.in_process:
        parser.error("--warm-spare needs --in-process")
    return targs
