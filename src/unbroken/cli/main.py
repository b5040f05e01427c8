"""The `unbroken` command: ls, show, verify, export, convert, tokenise, gc, demo, run.

Exit codes (also in ``unbroken --help`` and the README): 0 ok, 1 damage found, 2 usage or
input error. The commands run in `unbroken.cli.commands`; this module holds only the
parser, so that ``unbroken --help`` imports neither torch nor rich (it takes a tenth of
a second, not seconds: bench/cli_startup.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from unbroken.errors import CheckpointError, CorruptCheckpointError

OK, DAMAGED, USAGE = 0, 1, 2
EXIT_CODES = """exit codes:
  0  ok
  1  damage found: a file or checksum does not match its manifest (verify; a damaged
     manifest anywhere)
  2  usage or input error: bad option, missing path or step, existing output without
     --force, a training script that does not exist
`unbroken run` exits with the training job's own code once the job has started."""
S3_HELP = """s3:// paths: the endpoint, region and credentials come from the options above or
the environment (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, AWS_ALLOW_HTTP=true for plain HTTP to a host that is not this machine)."""
# The commands that parse their own options (`_elsewhere`, `_tokenise`).
SUMMARIES = {
    "tokenise": "tokenise a corpus once into a memory-mapped token file (or --verify one)",
    "demo": "train, kill and resume a small GPT under torchrun (about a minute; see README)",
    "run": "torchrun with restarts, hang detection and fault injection",
    "coordinator": "the store of a multi-node `run --in-process` job",
    "goodput": "goodput and badput by cause of a run, from its event logs",
    "simulate": "project goodput at cluster scale (discrete-event)",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # a reader that went away shows here, not at exit
        return code
    except SystemExit as e:  # argparse and `unbroken run`'s checks: usage errors, --help
        if e.code is None or isinstance(e.code, int):
            return e.code or OK
        print(e.code, file=sys.stderr)
        return USAGE
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130  # what a shell reports for a process ended by Ctrl-C


def _reader_gone() -> int:
    """``unbroken show ... | head``: the reader has what it wanted. Exit quietly with 0,
    as the shell's own tools do, and point stdout at /dev/null so that Python's final
    flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (a test's capture): nothing to flush
        pass
    return OK


def _dispatch(args: list[str]) -> int:
    if args[:1] and args[0] in SUMMARIES and args[0] != "tokenise":
        return _elsewhere(args[0])(args[1:])
    if args[:1] and args[0] in ("tokenise", "tokenize"):
        return _tokenise(args)
    opts = _parser().parse_args(args)
    module: ModuleType
    if opts.command in ("export", "convert"):  # torch: only the commands that write need it
        from unbroken.cli import writing as module
    else:
        from unbroken.cli import commands as module
    try:
        return int(getattr(module, opts.command)(opts))
    except BrokenPipeError:  # an OSError, but no error of the input: see `main`
        raise
    except CorruptCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return DAMAGED
    except (CheckpointError, OSError, ValueError) as e:  # ValueError: S3 options' checks
        print(f"error: {e}", file=sys.stderr)
        return USAGE


def _elsewhere(name: str) -> Callable[[list[str]], int]:
    """The ``main(argv)`` of a command another wing owns, each with its own parser,
    imported only when named (``run`` before argparse: torchrun's options pass through)."""
    if name == "demo":
        from unbroken.demo.run import main as demo

        return demo
    if name == "run":
        from unbroken.run.cli import main as run

        return run
    if name == "goodput":
        from unbroken.goodput.cli import main as goodput

        return goodput
    if name == "simulate":
        from unbroken.goodput.simulate_cli import main as simulate

        return simulate
    from unbroken.run.coordinator_cli import main as coordinator

    return coordinator


def _tokenise(args: list[str]) -> int:
    from unbroken.data import command as tokenise  # numpy: only for this command

    parser = argparse.ArgumentParser(prog="unbroken")
    tokenise.add_parser(parser.add_subparsers(required=True), EXIT_CODES)
    opts = parser.parse_args(args)
    try:
        return int(opts.func(opts))
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as e:  # an input it cannot read: name it, no traceback
        where = f"{e.filename}: " if isinstance(e, OSError) and e.filename else ""
        print(f"error: {where}{getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return USAGE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unbroken",
        description="Inspect, verify and export unbroken checkpoints; run the demo; launch "
        "training with restarts.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    ls = _command(sub, "ls", "list committed checkpoints (or the subfolders holding them)")
    _json_flag(ls)
    show = _command(sub, "show", "tensors and non-tensor state of one checkpoint")
    show.add_argument("--step", type=int, help="default: the newest")
    _json_flag(show)
    ver = _command(sub, "verify", "re-read every byte and check every checksum")
    which = ver.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="default: the newest")
    which.add_argument("--all", action="store_true", help="every committed step")
    _json_flag(ver)
    _quiet_flag(ver)
    _export_command(sub)
    conv = _command(sub, "convert", "a DCP checkpoint to unbroken's format, or back", s3=False)
    conv.add_argument("dst", help="where to write: an unbroken directory, or a local folder")
    conv.add_argument("--to", choices=["unbroken", "dcp"], required=True)
    conv.add_argument("--step", type=int, help="step to write (unbroken, default 0) or read (dcp)")
    conv.add_argument(
        "--trust-pickle", action="store_true", help="--to unbroken: unpickle DCP's .metadata "
        "(it can run any code it holds; only for checkpoints you trust)"
    )  # fmt: skip
    conv.add_argument("--force", action="store_true", help="--to dcp: replace DST's checkpoint")
    sub.add_parser("tokenise", aliases=["tokenize"], help=SUMMARIES["tokenise"])
    _gc_command(sub)
    for name, summary in SUMMARIES.items():
        if name != "tokenise":
            sub.add_parser(name, help=summary)
    return parser


def _command(sub: Any, name: str, summary: str, s3: bool = True) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help=summary,
        description=summary,
        epilog=f"{S3_HELP}\n\n{EXIT_CODES}" if s3 else EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="checkpoint directory: a local path or a URL (s3://...)")
    p.set_defaults(command=name, json=False, quiet=False)
    if s3:
        _s3_options(p)
    return p


def _s3_options(p: argparse.ArgumentParser) -> None:
    s3 = p.add_argument_group("s3:// paths")
    s3.add_argument("--endpoint", metavar="URL", help="e.g. http://127.0.0.1:9000 (MinIO)")
    s3.add_argument("--region", help="e.g. us-east-1 (default: AWS_REGION)")
    s3.add_argument(
        "--path-style", action=argparse.BooleanOptionalAction, help="bucket in the path, "
        "not the host name (default: on for an IP address or localhost endpoint)"
    )  # fmt: skip
    s3.add_argument("--allow-http", action="store_true", help="plain HTTP to a remote host")


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (README)")


def _quiet_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def _export_command(sub: Any) -> None:
    exp = _command(sub, "export", "consolidated safetensors weights for inference")
    exp.add_argument("out", help="the .safetensors file (--format hf: the folder) to write")
    exp.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="one file, or a Hugging Face folder (shards, index, config)",
    )
    exp.add_argument("--max-shard-size", default="5GB", help="--format hf: e.g. 5GB, 500MiB")
    exp.add_argument("--config", help="--format hf: a transformers config.json to include")
    exp.add_argument(
        "--strip-prefix",
        action="append",
        default=[],
        help="remove this prefix from tensor names, e.g. model. (repeatable)",
    )
    exp.add_argument("--step", type=int, help="default: the newest")
    exp.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    exp.add_argument(
        "--only", action="append", help="state entry to export (repeatable; default: model)"
    )
    exp.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    _quiet_flag(exp)


def _gc_command(sub: Any) -> None:
    gc = _command(sub, "gc", "delete the checkpoints retention lets go (what keep= does)")
    gc.add_argument("--keep-last", type=int, help="the newest K steps")
    gc.add_argument("--keep-every", type=int, help="every step that is a multiple of M")
    gc.add_argument("--keep-per-window", help="the newest step of each window, e.g. 1d, 6h")
    gc.add_argument("--keep-best", type=int, help="the K steps with the lowest metric")
    gc.add_argument("--best-mode", choices=["min", "max"], default="min")
    gc.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")
