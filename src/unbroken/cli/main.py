"""The `unbroken` command: ls, show, verify, export, convert, tokenise, gc, demo, run.

Exit codes (also in ``unbroken --help`` and the README): 0 ok, 1 damage found, 2 usage or
input error. ``--json`` output (ls, show, verify) is built by `unbroken.cli.output`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from unbroken import retention, sdc
from unbroken.cli import output
from unbroken.data import command as tokenise
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.directory import Directory
from unbroken.format.offline import consolidate, selected_bytes, verify
from unbroken.saving.committed import let_go, read_info
from unbroken.state import leaves
from unbroken.storage import open_storage

OK, DAMAGED, USAGE = 0, 1, 2
EXIT_CODES = """exit codes:
  0  ok
  1  damage found: a file or checksum does not match its manifest (verify; a damaged
     manifest anywhere)
  2  usage or input error: bad option, missing path or step, existing output without
     --force, a training script that does not exist
`unbroken run` exits with the training job's own code once the job has started."""

# Wide enough for long tensor names when the output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 160)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        return _dispatch(args)
    except SystemExit as e:  # argparse and `unbroken run`'s checks: usage errors, --help
        if e.code is None or isinstance(e.code, int):
            return e.code or OK
        print(e.code, file=sys.stderr)
        return USAGE


def _dispatch(args: list[str]) -> int:
    if args[:1] == ["demo"]:
        from unbroken.demo.run import main as demo

        return demo(args[1:])
    if args[:1] == ["run"]:  # before argparse: torchrun's options pass through untouched
        from unbroken.run.cli import main as run

        return run(args[1:])
    if args[:1] == ["goodput"]:
        from unbroken.goodput.cli import main as goodput

        return goodput(args[1:])
    if args[:1] == ["simulate"]:
        from unbroken.goodput.simulate_cli import main as simulate

        return simulate(args[1:])
    if args[:1] == ["coordinator"]:
        from unbroken.run.coordinator import main as coordinator

        return coordinator(args[1:])
    opts = _parser().parse_args(args)
    try:
        return int(opts.func(opts))
    except CorruptCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return DAMAGED
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
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
    ls = _command(sub, "ls", _ls, "list committed checkpoints (or the subfolders holding them)")
    _json_flag(ls)
    show = _command(sub, "show", _show, "tensors and non-tensor state of one checkpoint")
    show.add_argument("--step", type=int, help="default: the newest")
    _json_flag(show)
    ver = _command(sub, "verify", _verify, "re-read every byte and check every checksum")
    which = ver.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="default: the newest")
    which.add_argument("--all", action="store_true", help="every committed step")
    _json_flag(ver)
    _quiet_flag(ver)
    exp = _command(sub, "export", _export, "consolidated safetensors weights for inference")
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
    conv = _command(sub, "convert", _convert, "a DCP checkpoint to unbroken's format, or back")
    conv.add_argument("dst", help="where to write: an unbroken directory, or a local folder")
    conv.add_argument("--to", choices=["unbroken", "dcp"], required=True)
    conv.add_argument("--step", type=int, help="step to write (unbroken, default 0) or read (dcp)")
    conv.add_argument(
        "--trust-pickle", action="store_true", help="--to unbroken: unpickle DCP's .metadata "
        "(it can run any code it holds; only for checkpoints you trust)"
    )  # fmt: skip
    conv.add_argument("--force", action="store_true", help="--to dcp: replace DST's checkpoint")
    tokenise.add_parser(sub, EXIT_CODES)
    _gc_command(sub)
    sub.add_parser("demo", help="train, kill and resume a small GPT under torchrun (30-40 s)")
    sub.add_parser("run", help="torchrun with restarts, hang detection and fault injection")
    sub.add_parser("coordinator", help="the store of a multi-node `run --in-process` job")
    sub.add_parser("goodput", help="goodput and badput by cause of a run, from its event logs")
    sub.add_parser("simulate", help="project goodput at cluster scale (discrete-event)")
    return parser


def _command(
    sub: argparse._SubParsersAction,
    name: str,
    func: Callable[[argparse.Namespace], int],
    summary: str,
) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=summary, description=summary, epilog=EXIT_CODES)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("path", help="checkpoint directory: a local path or a URL (s3://...)")
    p.set_defaults(func=func, json=False, quiet=False)
    return p


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (README)")


def _quiet_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def _gc_command(sub: Any) -> None:
    gc = _command(sub, "gc", _gc, "delete the checkpoints retention lets go (what keep= does)")
    gc.add_argument("--keep-last", type=int, help="the newest K steps")
    gc.add_argument("--keep-every", type=int, help="every step that is a multiple of M")
    gc.add_argument("--keep-per-window", help="the newest step of each window, e.g. 1d, 6h")
    gc.add_argument("--keep-best", type=int, help="the K steps with the lowest metric")
    gc.add_argument("--best-mode", choices=["min", "max"], default="min")
    gc.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")


def _gc(opts: argparse.Namespace) -> int:
    rules: list[retention.Retention] = []
    if opts.keep_last:
        rules.append(retention.KeepLast(opts.keep_last))
    if opts.keep_every:
        rules.append(retention.KeepEvery(opts.keep_every))
    if opts.keep_per_window:
        rules.append(retention.KeepPerWindow(_seconds(opts.keep_per_window)))
    if opts.keep_best:
        rules.append(retention.KeepBest(opts.keep_best, opts.best_mode))
    if not rules:
        raise CheckpointError("name what to keep: --keep-last, --keep-every, ... (see --help)")
    directory = _open(opts.path)
    infos = [read_info(directory, s) for s in directory.steps()]
    doomed = let_go(directory, retention.KeepAny(tuple(rules)), infos)  # as keep= does
    kept = [i.step for i in infos if i.step not in doomed]
    verb = "would delete" if opts.dry_run else "deleting"
    console.print(f"{opts.path}: keeping {kept}; {verb} {doomed}", highlight=False)
    for step in [] if opts.dry_run else doomed:
        directory.delete(step)
    return OK


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1:] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise CheckpointError(f"--keep-per-window {text!r}: seconds, or 12h, 1d") from None


def _open(path: str) -> Directory:
    if not os.path.exists(path) and "://" not in path:
        raise CheckpointError(f"{path} does not exist")
    return Directory(open_storage(path), path)


def _subfolders(path: str) -> dict[str, Directory]:
    """The folders directly under ``path`` that hold committed checkpoints, by path."""
    found = {}
    for name in sorted(open_storage(path).list("")):
        sub = os.path.join(path, name) if "://" not in path else f"{path.rstrip('/')}/{name}"
        if "://" not in path and not os.path.isdir(sub):
            continue
        directory = Directory(open_storage(sub), sub)
        if directory.steps():
            found[sub] = directory
    return found


def _ls(opts: argparse.Namespace) -> int:
    directory = _open(opts.path)
    steps = directory.steps()
    subs = {} if steps else _subfolders(opts.path)
    if opts.json:
        output.dump(output.ls(opts.path, directory, steps, subs))
        return OK
    if steps:
        _ls_table(opts.path, directory, steps)
    elif subs:
        console.print(
            f"{opts.path} holds no checkpoints itself; {len(subs)} of its subfolders do:",
            highlight=False,
        )
        for sub, subdir in subs.items():
            _ls_table(sub, subdir, subdir.steps())
        console.print(f"one of them: unbroken ls {next(iter(subs))}", highlight=False)
    else:
        console.print(f"{opts.path}: no committed checkpoints, nor in its subfolders")
    return OK


def _ls_table(path: str, directory: Directory, steps: list[int]) -> None:
    table = Table("step", "size", "tensors", "ranks", "saved", title=path)
    for step in steps:
        m = directory.manifest(step)
        table.add_row(
            str(step), _size(m.nbytes), str(len(m.tensors)), str(m.world_size), _time(m.created)
        )
    console.print(table)


def _show(opts: argparse.Namespace) -> int:
    m = _open(opts.path).manifest(opts.step)
    if opts.json:
        output.dump(output.show(opts.path, m))
        return OK
    console.print(
        f"step {m.step}: {_size(m.nbytes)} in {len(m.files)} files, saved by {m.world_size} "
        f"ranks at {_time(m.created)} (format version {m.version})",
        highlight=False,
    )
    if note := sdc.report(_open(opts.path).storage, m.step):
        console.print(f"[yellow]SUSPECT[/yellow] {note}", highlight=False)
    table = Table("tensor", "dtype", "shape", "blocks", "size")
    for key, entry in m.tensors.items():
        table.add_row(
            key,
            entry.dtype,
            str(tuple(entry.shape)),
            str(len(entry.chunks)),
            _size(sum(c.nbytes for c in entry.chunks)),
        )
    console.print(table)
    values = Table("key", "value", title="non-tensor state (rank 0)")
    for path, value in leaves(m.objects_for(0)):
        text = repr(value)
        values.add_row(path, text if len(text) <= 60 else text[:57] + "...")
    console.print(values)
    if len(m.objects) > 1:
        console.print(f"{len(m.objects)} distinct per-rank versions of the non-tensor state")
    return OK


def _verify(opts: argparse.Namespace) -> int:
    directory = _open(opts.path)
    steps = directory.steps() if opts.all else [directory.manifest(opts.step).step]
    results = []
    for step in steps:
        m = directory.manifest(step)
        with _bar(opts) as bar:
            task = bar.add_task(
                f"reading step {step}",
                total=sum(c.nbytes for e in m.tensors.values() for c in e.chunks),
            )
            damage = verify(directory, m, partial(bar.advance, task))
        results.append((m, damage))
        if opts.json:
            continue
        for line in output.verdicts(step, damage):
            console.print(line, highlight=False, soft_wrap=True)  # unwrapped: paths to copy
    if opts.json:
        output.dump(output.verify(opts.path, results))
    return DAMAGED if any(damage for _, damage in results) else OK


def _export(opts: argparse.Namespace) -> int:
    from unbroken.access import Access
    from unbroken.cli import hf_export

    if os.path.exists(opts.out) and not opts.force:
        raise CheckpointError(f"{opts.out} already exists; pass --force to overwrite it")
    if opts.format != "hf" and opts.config:
        raise CheckpointError("--config needs --format hf")
    if opts.format != "hf":  # the hf folder is made with its parents
        hf_export.check_destination(opts.out)
    directory = _open(opts.path)
    m = directory.manifest(opts.step)
    dtype = getattr(torch, opts.dtype) if opts.dtype else None
    only = opts.only or ["model"]
    with _bar(opts) as bar:
        task = bar.add_task(f"reading step {m.step}", total=selected_bytes(m, only))
        advance = partial(bar.advance, task)
        if opts.format == "hf":
            done = hf_export.export(
                directory, m, opts.out, only=only, dtype=dtype, strip=opts.strip_prefix,
                max_shard_size=hf_export.parse_size(opts.max_shard_size), config=opts.config,
                progress=advance,
            )  # fmt: skip
            tied = "".join(f", {a} tied to {b}" for a, b in done.tied.items())
            console.print(
                f"wrote {done.tensors} tensors, {_size(done.nbytes)}, in {len(done.files) - 1} "
                f"shard(s) to {opts.out}{tied}",
                highlight=False,
            )
            return OK
        tensors = dict(consolidate(directory, m, only, dtype, advance, opts.strip_prefix))
    partial_out = f"{opts.out}.partial"  # a reader never sees half a file under OUT
    meta = {**hf_export.METADATA, "unbroken_step": str(m.step)}
    hf_export.save_file(tensors, partial_out, meta, Access.from_env())
    os.replace(partial_out, opts.out)
    size = sum(t.nbytes for t in tensors.values())
    console.print(f"wrote {len(tensors)} tensors, {_size(size)}, to {opts.out}", highlight=False)
    return OK


def _convert(opts: argparse.Namespace) -> int:
    from unbroken.dcp.convert import command

    return command(opts)


def _bar(opts: argparse.Namespace) -> Progress:
    """Bytes and speed on stderr; off with --quiet or --json, or unless both stdout and
    stderr are terminals (a log file or a pipe gets no bar)."""
    shown = not (opts.quiet or opts.json) and sys.stdout.isatty() and sys.stderr.isatty()
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not shown,
    )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _time(created: float) -> str:
    return datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")
