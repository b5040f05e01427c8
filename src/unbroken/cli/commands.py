"""The checkpoint commands that read: ls, show, verify, and gc (`unbroken.cli.main`
parses their options; `unbroken.cli.writing` holds export and convert).

Each takes the parsed options and returns the exit code; errors are raised as
`CheckpointError` (exit 2) or `CorruptCheckpointError` (exit 1) for ``main`` to print.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from functools import partial
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from unbroken.cli import output
from unbroken.errors import CheckpointError
from unbroken.format.directory import Directory
from unbroken.storage import open_storage

OK, DAMAGED = 0, 1


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (``unbroken show ... | head``): rich's own handling exits
        with 1, which says "damage found"; `unbroken.cli.main` ends quietly with 0."""
        self.quiet = True
        raise BrokenPipeError


# Wide enough for long tensor names when the output goes to a file or a pipe.
console = _Console(width=None if sys.stdout.isatty() else 160)


def storage_options(opts: argparse.Namespace) -> dict[str, Any] | None:
    """The S3 options the command line gives (``--endpoint``...), None if it gives none;
    `unbroken.storage.s3_options.S3Options` checks them."""
    given = {
        "endpoint": opts.endpoint,
        "region": opts.region,
        "path_style": opts.path_style,
        "allow_http": opts.allow_http or None,
    }
    options = {k: v for k, v in given.items() if v is not None}
    if options and "://" not in opts.path:
        flags = ", ".join("--" + k.replace("_", "-") for k in options)
        raise CheckpointError(f"{flags}: only for s3:// paths, and {opts.path} is a local path")
    return options or None


def open_directory(opts: argparse.Namespace, path: str | None = None) -> Directory:
    path = opts.path if path is None else path
    if not os.path.exists(path) and "://" not in path:
        raise CheckpointError(f"{path} does not exist")
    return Directory(open_storage(path, storage_options(opts)), path)


def _subfolders(opts: argparse.Namespace) -> dict[str, Directory]:
    """The folders directly under ``opts.path`` that hold committed checkpoints."""
    path, found = opts.path, {}
    for name in sorted(open_storage(path, storage_options(opts)).list("")):
        sub = os.path.join(path, name) if "://" not in path else f"{path.rstrip('/')}/{name}"
        if "://" not in path and not os.path.isdir(sub):
            continue
        directory = open_directory(opts, sub)
        if directory.steps():
            found[sub] = directory
    return found


def ls(opts: argparse.Namespace) -> int:
    """Every committed step; one whose manifest cannot be read is listed as damaged (and
    the exit code is 1), the others as usual."""
    directory = open_directory(opts)
    steps = directory.steps()
    subs = {} if steps else _subfolders(opts)
    listed = {opts.path: directory} if steps else subs
    damaged = False
    if opts.json:
        result = output.ls(opts.path, directory, steps, subs)
        output.dump(result)
        return DAMAGED if output.any_damaged(result) else OK
    if subs:
        console.print(
            f"{opts.path} holds no checkpoints itself; {len(subs)} of its subfolders do:",
            highlight=False,
        )
    for path, d in listed.items():
        damaged |= _ls_table(path, d, d.steps())
    if subs:
        console.print(f"one of them: unbroken ls {next(iter(subs))}", highlight=False)
    if not listed:
        console.print(f"{opts.path}: no committed checkpoints, nor in its subfolders")
    return DAMAGED if damaged else OK


def _ls_table(path: str, directory: Directory, steps: list[int]) -> bool:
    """Print the table of ``steps``; whether any of them is damaged."""
    table = Table("step", "size", "tensors", "ranks", "saved", title=path)
    problems = []
    for step in steps:
        try:
            m = directory.manifest(step)
        except CheckpointError as e:
            table.add_row(str(step), "[red]DAMAGED[/red]", "-", "-", "-")
            problems.append(f"[red]DAMAGED[/red] step {step}: {escape(str(e))}")
            continue
        table.add_row(
            str(step), size(m.nbytes), str(len(m.tensors)), str(m.world_size), _time(m.created)
        )
    console.print(table)
    for line in problems:
        console.print(line, highlight=False, soft_wrap=True)
    return bool(problems)


def show(opts: argparse.Namespace) -> int:
    from unbroken.format import marks
    from unbroken.tree import leaves

    directory = open_directory(opts)
    m = directory.manifest(opts.step)
    if opts.json:
        output.dump(output.show(opts.path, m))
        return OK
    console.print(
        f"step {m.step}: {size(m.nbytes)} in {len(m.files)} files, saved by {m.world_size} "
        f"ranks at {_time(m.created)} (format version {m.version})",
        highlight=False,
    )
    if note := marks.report(directory.storage, m.step):
        console.print(f"[yellow]SUSPECT[/yellow] {note}", highlight=False)
    table = Table("tensor", "dtype", "shape", "blocks", "size")
    for key, entry in m.tensors.items():
        table.add_row(
            key,
            entry.dtype,
            str(tuple(entry.shape)),
            str(len(entry.chunks)),
            size(sum(c.nbytes for c in entry.chunks)),
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


def verify(opts: argparse.Namespace) -> int:
    from unbroken.format.audit import verify as check

    directory = open_directory(opts)
    steps = directory.steps() if opts.all else [directory.manifest(opts.step).step]
    results = []
    for step in steps:
        m = directory.manifest(step)
        with bar(opts) as progress:
            task = progress.add_task(
                f"reading step {step}",
                total=sum(c.nbytes for e in m.tensors.values() for c in e.chunks),
            )
            damage = check(directory, m, partial(progress.advance, task))
        results.append((m, damage))
        if opts.json:
            continue
        for line in output.verdicts(step, damage):
            console.print(line, highlight=False, soft_wrap=True)  # unwrapped: paths to copy
    if opts.json:
        output.dump(output.verify(opts.path, results))
    return DAMAGED if any(damage for _, damage in results) else OK


def gc(opts: argparse.Namespace) -> int:
    from unbroken.saving.committed import let_go, read_info

    rule = _retention(opts)
    directory = open_directory(opts)
    infos = [read_info(directory, s) for s in directory.steps()]
    if opts.keep_best is not None and infos and all(i.metric is None for i in infos):
        raise CheckpointError(
            f"--keep-best: none of the {len(infos)} steps in {opts.path} was saved with a "
            "metric (Checkpointer.save(step, state, metric=loss)), so there is nothing to "
            "rank; nothing deleted. Use --keep-last or --keep-every instead"
        )
    doomed = let_go(directory, rule, infos)  # as keep= does
    kept = [i.step for i in infos if i.step not in doomed]
    verb = "would delete" if opts.dry_run else "deleting"
    console.print(f"{opts.path}: keeping {kept}; {verb} {doomed}", highlight=False)
    for step in [] if opts.dry_run else doomed:
        directory.delete(step)
    return OK


def _retention(opts: argparse.Namespace) -> Any:
    from unbroken import retention

    for flag in ("keep_last", "keep_every", "keep_best"):
        value = getattr(opts, flag)
        if value is not None and value < 1:
            name = "--" + flag.replace("_", "-")
            raise CheckpointError(f"{name} {value}: give a count of at least 1")
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
    return retention.KeepAny(tuple(rules))


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:  # also NaN
        raise CheckpointError(f"--keep-per-window {text!r}: a length such as 3600, 12h or 1d")
    return seconds


def bar(opts: argparse.Namespace) -> Progress:
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


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _time(created: float) -> str:
    return datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")
