"""``unbroken demo``: kill a real distributed training job and resume it exactly.

Three torchrun launches of `unbroken.demo.train` (2 ranks, gloo, CPU):

1. an uninterrupted reference run, in its own checkpoint directory;
2. the same run, SIGKILLed (launcher and workers, all at once) once it passes ``--kill-at``;
3. a fresh launch on the killed run's directory, which restores the newest committed
   checkpoint and trains to the end.

Then the two loss curves are compared step by step for exact (bitwise) equality.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from unbroken.data.files import sidecar
from unbroken.demo import EVENT_PREFIX
from unbroken.demo.model import tokenise_corpus
from unbroken.demo.report import (
    VERDICT_DIFFERENT,
    VERDICT_EQUAL,
    Launch,
    have_matplotlib,
    mismatches,
    plot,
    report,
)
from unbroken.run.procs import kill_tree

LAUNCH_TIMEOUT_S = 120.0  # one launch takes ~10 s; past this it is hung
# Measured: 30-37 s for the three launches on 2 idle cores; 86-139 s on 2 cores shared with
# other work. Each launch starts 3 Python processes that import torch: CPU-bound start-up.
EXPECTED_TIME = "30-40 s on 2 idle CPU cores, longer on a busy machine"
TIMELINE = "timeline.json"
TOKENS = "corpus.tokens"  # the tokenised corpus, with its sidecar TOKENS.json


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="unbroken demo",
        description="Train a tiny GPT with DDP under torchrun, SIGKILL it mid-run, resume it "
        "from the last checkpoint and show that the loss curve is bitwise identical to an "
        f"uninterrupted run. Takes {EXPECTED_TIME} with the defaults; keeps the "
        "checkpoints and the recovery timeline in a directory it names at the end.",
    )
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint interval (10)")
    p.add_argument("--kill-at", type=int, default=35, help="SIGKILL once past this step (35)")
    p.add_argument(
        "--dir",
        type=Path,
        help="where the checkpoints and the timeline go, kept at the end "
        "(default: ./unbroken-demo-DATE-TIME)",
    )
    p.add_argument("--clean", action="store_true", help="delete them at the end")
    p.add_argument("--plot", type=Path, metavar="PNG", help="also plot both curves (matplotlib)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.steps < 2 or args.save_every < 1:
        p.error("--steps must be at least 2 and --save-every at least 1")
    if not 0 < args.kill_at < args.steps:
        p.error(f"--kill-at must be between 1 and {args.steps - 1}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    console = Console(highlight=False)
    if args.plot is not None and not have_matplotlib():
        console.print(
            "[red]--plot needs matplotlib, which is not installed.[/]\n"
            "Install it with: pip install 'unbroken\\[plot]'"
        )
        return 2
    root = args.dir or default_dir()
    created = not root.exists()
    for d in (root / "uninterrupted", root / "killed"):
        if d.exists() and any(d.iterdir()):
            console.print(f"[red]{escape(str(d))} is not empty;[/] pass an empty or new --dir")
            return 2
    root.mkdir(parents=True, exist_ok=True)
    try:
        code = _demo(console, args, root)
    finally:
        _keep_or_clean(console, root, created, args.clean)
    return code


def default_dir() -> Path:
    """A new folder in the current directory, where the user will find it again."""
    return Path(f"unbroken-demo-{time.strftime('%Y%m%d-%H%M%S')}")


def _demo(console: Console, args: argparse.Namespace, root: Path) -> int:
    """The three launches and the report; the exit code (0: EQUAL)."""
    ref_dir, run_dir = root / "uninterrupted", root / "killed"
    console.print(
        f"[bold]unbroken demo[/]: tiny GPT, DDP on 2 CPU ranks (torchrun, gloo), "
        f"{EXPECTED_TIME} with the defaults\n{args.steps} steps, checkpoint every "
        f"{args.save_every}, SIGKILL once past step {args.kill_at}\n"
        f"checkpoints in {escape(str(root))}\n"
    )
    launches: dict[str, Launch] = {}
    tokenise_corpus(root / TOKENS)  # once: every launch memory-maps it
    try:
        ref = launches["uninterrupted"] = _run(console, "uninterrupted run", ref_dir, args)
        if not _check(console, ref, "the uninterrupted run"):
            return 1
        first = launches["killed"] = _run(console, "run to be killed", run_dir, args, args.kill_at)
        if not first.killed:
            _fail(console, first, "the run finished before it could be killed")
            return 1
        resumed = launches["resumed"] = _run(console, "resumed run", run_dir, args)
        if not _check(console, resumed, "the resumed run"):
            return 1
        equal = report(console, args, ref, first, resumed)
    finally:
        _write_timeline(root / TIMELINE, args, launches)
    if args.plot is not None:
        plot(args.plot, args, ref, first, resumed)
        console.print(f"plot written to {escape(str(args.plot))}")
    return 0 if equal else 1


def _write_timeline(path: Path, args: argparse.Namespace, launches: dict[str, Launch]) -> None:
    """The recovery timeline: each launch's start (seconds since the epoch), duration,
    restored step, last step, how it ended, and its losses (step -> loss, exact)."""
    record = {
        "steps": args.steps,
        "save_every": args.save_every,
        "kill_at": args.kill_at,
        "seed": args.seed,
        "launches": {
            name: {
                "started": launch.started_at,
                "seconds": round(launch.seconds, 3),
                "checkpoints": "uninterrupted" if name == "uninterrupted" else "killed",
                "restored": launch.restored,
                "last_step": launch.last_step,
                "killed": launch.killed,
                "returncode": launch.returncode,
                "losses": {str(s): v for s, v in sorted(launch.losses.items())},
            }
            for name, launch in launches.items()
        },
    }
    if "resumed" in launches:
        bad = mismatches(
            args.steps, launches["uninterrupted"], launches["killed"], launches["resumed"]
        )
        record["verdict"] = VERDICT_DIFFERENT if bad else VERDICT_EQUAL
        record["mismatched_steps"] = bad
    path.write_text(json.dumps(record, indent=1))


def _keep_or_clean(console: Console, root: Path, created: bool, clean: bool) -> None:
    """Delete what the demo wrote (--clean), or say where it is and what to try on it."""
    if clean:
        for name in ("uninterrupted", "killed", "events"):
            shutil.rmtree(root / name, ignore_errors=True)
        for name in (TIMELINE, TOKENS, sidecar(TOKENS).name):
            (root / name).unlink(missing_ok=True)
        if created and not any(root.iterdir()):
            root.rmdir()
        console.print(f"\n--clean: deleted what the demo wrote in {escape(str(root))}")
        return
    d = escape(str(root))
    console.print(
        f"\nKept in [bold]{d}[/]: the checkpoints of both runs (killed/ holds the killed and "
        f"resumed run's), the tokenised corpus ({TOKENS}) and the recovery timeline "
        f"({TIMELINE}). Try:\n"
        + "".join(f"  {escape(c)}\n" for c in hints(root))
        + f"Delete it with: rm -r {d}   (or run the demo with --clean)",
        soft_wrap=True,  # never break a command the user may copy
    )


def hints(root: Path) -> list[str]:
    """The commands to try on what the demo kept, only on what is there: after a failed
    launch the killed run may have no checkpoint, and no event log."""
    runs = [root / name for name in ("killed", "uninterrupted") if _has_checkpoints(root / name)]
    commands = [f"unbroken ls {root}"]
    if runs:
        commands += [
            f"unbroken verify {runs[0]} --all",
            f"unbroken show {runs[0]}",
            f"unbroken export {runs[0]} {root / 'model.safetensors'} --force",
        ]
    events = root / "events" / "killed"
    if events.is_dir() and any(events.iterdir()):
        commands.append(f"unbroken goodput {events}")
    return commands


def _has_checkpoints(folder: Path) -> bool:
    return any(folder.glob("step-*/manifest.json"))  # committed: its manifest is written


# --- launching and killing -------------------------------------------------------------


def _torchrun(ckpt_dir: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # c10d rendezvous on a free localhost port
        "--nproc-per-node=2",
        "--max-restarts=0",  # a failure must end the job: the demo does the restarting
        "-m",
        "unbroken.demo.train",
        f"--dir={ckpt_dir}",
        f"--data={ckpt_dir.parent / TOKENS}",
        f"--steps={args.steps}",
        f"--save-every={args.save_every}",
        f"--seed={args.seed}",
    ]


def _run(
    console: Console,
    title: str,
    ckpt_dir: Path,
    args: argparse.Namespace,
    kill_at: int | None = None,
) -> Launch:
    with console.status(f"{title}: starting torchrun..."):
        launch = _launch(_torchrun(ckpt_dir, args), kill_at)
    where = "from scratch" if launch.restored is None else f"from step {launch.restored}"
    how = (
        f"[red]SIGKILL[/] after step {launch.last_step}"
        if launch.killed
        else f"exit code {launch.returncode}"
    )
    console.print(
        f"  {title:<17} {launch.seconds:5.1f} s  {where:<14} -> step {launch.last_step:<4} {how}"
    )
    return launch


def _launch(cmd: list[str], kill_at: int | None) -> Launch:
    """Run torchrun, collecting its events; SIGKILL it all once it passes ``kill_at``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = Launch(started_at=time.time())
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
        start_new_session=True,  # its own process group, so we can kill the whole group
    )

    def on_timeout() -> None:  # a hung job (a collective that never ends) must not hang us
        launch.timed_out = True
        kill_tree(proc.pid)

    watchdog = threading.Timer(LAUNCH_TIMEOUT_S, on_timeout)
    watchdog.start()
    try:
        assert proc.stdout is not None
        # Reading on after the kill drains what the job printed before it died; the pipe
        # ends when the last process holding it is gone.
        for line in proc.stdout:
            event = _parse_event(line)
            if event is None:
                launch.log.append(line.rstrip("\n"))
            elif event["event"] == "start":
                launch.started, launch.restored = True, event["restored"]
            elif event["event"] == "step":
                launch.losses[int(event["step"])] = float(event["loss"])
                if kill_at is not None and event["step"] >= kill_at and not launch.killed:
                    kill_tree(proc.pid)
                    launch.killed = True
            elif event["event"] == "done":
                launch.finished = True
        launch.returncode = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    launch.seconds = time.monotonic() - t0
    return launch


def _parse_event(line: str) -> dict[str, Any] | None:
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX) :])
    except json.JSONDecodeError:
        return None  # mangled (say, by another process writing mid-line): keep it as log
    return event if isinstance(event, dict) else None


def _check(console: Console, launch: Launch, what: str) -> bool:
    if launch.returncode == 0 and launch.finished:
        return True
    if launch.timed_out:
        _fail(console, launch, f"{what} hung and was killed after {LAUNCH_TIMEOUT_S:.0f} s")
    else:
        _fail(console, launch, f"{what} failed (exit code {launch.returncode})")
    return False


def _fail(console: Console, launch: Launch, message: str) -> None:
    shown, skipped = first_error(launch.log)
    console.print(f"[red]error:[/] {escape(message)}; its first error:")
    console.print("\n".join(shown), markup=False, highlight=False)
    if skipped:
        console.print(f"({skipped} more lines of output after it)")


# The first line of what went wrong: a traceback, an exception, or a tool's "error:".
_ERROR = re.compile(r"Traceback \(most recent|\b\w*(Error|Exception)\b|\berror:", re.IGNORECASE)


def first_error(log: list[str], lines: int = 30) -> tuple[list[str], int]:
    """The first error of ``log`` and the ``lines`` after it (the cause: what other ranks
    print later is mostly the consequence, a peer's abort), and how many lines that
    leaves out; the last ``lines`` where no line looks like an error."""
    start = next((i for i, line in enumerate(log) if _ERROR.search(line)), None)
    if start is None:
        return log[-lines:], 0
    shown = log[start : start + lines]
    return shown, len(log) - start - len(shown)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
