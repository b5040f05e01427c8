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
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from unbroken.demo import EVENT_PREFIX
from unbroken.run.procs import kill_tree

VERDICT_EQUAL = "EQUAL"
VERDICT_DIFFERENT = "DIFFERENT"
LAUNCH_TIMEOUT_S = 120.0  # one launch takes ~10 s; past this it is hung


@dataclass
class Launch:
    """What one torchrun launch reported."""

    losses: dict[int, float] = field(default_factory=dict)
    restored: int | None = None
    started: bool = False
    finished: bool = False
    killed: bool = False
    returncode: int = 0
    timed_out: bool = False
    seconds: float = 0.0
    log: list[str] = field(default_factory=list)  # every line that was not an event

    @property
    def last_step(self) -> int:
        return max(self.losses, default=0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="unbroken demo",
        description="Train a tiny GPT with DDP under torchrun, SIGKILL it mid-run, resume it "
        "from the last checkpoint and show that the loss curve is bitwise identical to an "
        "uninterrupted run.",
    )
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint interval (10)")
    p.add_argument("--kill-at", type=int, default=35, help="SIGKILL once past this step (35)")
    p.add_argument("--dir", type=Path, help="where checkpoints go (default: a temp dir)")
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
    if args.plot is not None and not _have_matplotlib():
        console.print(
            "[red]--plot needs matplotlib, which is not installed.[/]\n"
            "Install it with: pip install 'unbroken\\[plot]'"
        )
        return 2
    with _workdir(args.dir) as root:
        ref_dir, run_dir = root / "uninterrupted", root / "killed"
        for d in (ref_dir, run_dir):
            if d.exists() and any(d.iterdir()):
                console.print(f"[red]{escape(str(d))} is not empty;[/] pass an empty or new --dir")
                return 2
        console.print(
            f"[bold]unbroken demo[/]: tiny GPT, DDP on 2 CPU ranks (torchrun, gloo)\n"
            f"{args.steps} steps, checkpoint every {args.save_every}, "
            f"SIGKILL once past step {args.kill_at}\ncheckpoints in {escape(str(root))}\n"
        )
        ref = _run(console, "uninterrupted run", ref_dir, args)
        if not _check(console, ref, "the uninterrupted run"):
            return 1
        first = _run(console, "run to be killed", run_dir, args, kill_at=args.kill_at)
        if not first.killed:
            _fail(console, first, "the run finished before it could be killed")
            return 1
        resumed = _run(console, "resumed run", run_dir, args)
        if not _check(console, resumed, "the resumed run"):
            return 1

    equal = _report(console, args, ref, first, resumed)
    if args.plot is not None:
        _plot(args.plot, args, ref, first, resumed)
        console.print(f"plot written to {escape(str(args.plot))}")
    return 0 if equal else 1


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
    launch = Launch()
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


@contextlib.contextmanager
def _workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="unbroken-demo-") as tmp:
        yield Path(tmp)


def _check(console: Console, launch: Launch, what: str) -> bool:
    if launch.returncode == 0 and launch.finished:
        return True
    if launch.timed_out:
        _fail(console, launch, f"{what} hung and was killed after {LAUNCH_TIMEOUT_S:.0f} s")
    else:
        _fail(console, launch, f"{what} failed (exit code {launch.returncode})")
    return False


def _fail(console: Console, launch: Launch, message: str) -> None:
    console.print(f"[red]error:[/] {escape(message)}; its last output:")
    console.print("\n".join(launch.log[-40:]), markup=False)


# --- the report ------------------------------------------------------------------------


def _report(
    console: Console, args: argparse.Namespace, ref: Launch, first: Launch, resumed: Launch
) -> bool:
    restored = resumed.restored or 0
    killed_at = first.last_step
    curve = combined_curve(first, resumed)
    bad = mismatches(args.steps, ref, first, resumed)
    table = Table(title="loss per step (mean over both ranks)")
    table.add_column("step", justify="right")
    table.add_column("uninterrupted", justify="right")
    table.add_column("killed+resumed", justify="right")
    table.add_column("equal?", justify="center")
    table.add_column("")
    shown = _rows_to_show(args.steps, args.save_every, restored, killed_at, bad)
    for i, step in enumerate(shown):
        if i > 0 and step != shown[i - 1] + 1:
            table.add_row("...", "", "", "", "")
        a, b = ref.losses.get(step), curve.get(step)
        table.add_row(
            str(step),
            _fmt(a),
            _fmt(b),
            "[red]NO[/]" if step in bad else "[green]yes[/]",
            _note(step, args.save_every, restored, killed_at),
            end_section=step in (restored, killed_at),
        )
    console.print()
    console.print(table)

    lost = killed_at - restored
    if not bad:
        console.print(
            f"[bold green]Verdict: {VERDICT_EQUAL}[/] - all {args.steps} losses are bitwise "
            f"identical to the uninterrupted run\n(SIGKILL after step {killed_at}, restored "
            f"from step {restored}, {lost} lost step{'s' if lost != 1 else ''} recomputed)."
        )
        return True
    console.print(
        f"[bold red]Verdict: {VERDICT_DIFFERENT}[/] - {len(bad)} of {args.steps} steps differ "
        f"(first: step {bad[0]}); resumption was not exact."
    )
    return False


def mismatches(steps: int, ref: Launch, first: Launch, resumed: Launch) -> list[int]:
    """Steps whose losses are not bitwise equal (or missing) between the two curves.

    Every loss the killed launch printed counts too, including those of the steps that
    were lost and recomputed after the restore.
    """
    curve = combined_curve(first, resumed)
    bad = {s for s in range(1, steps + 1) if s not in ref.losses or curve.get(s) != ref.losses[s]}
    bad |= {s for s, v in first.losses.items() if ref.losses.get(s) != v}
    return sorted(bad)


def _rows_to_show(
    steps: int, save_every: int, restored: int, killed_at: int, bad: list[int]
) -> list[int]:
    """All steps of a short run; for a long one, the interesting steps and a sample."""
    if steps <= 100:
        return list(range(1, steps + 1))
    stride = max(save_every, steps // 40)
    keep = {1, steps, *bad, *range(max(1, restored - 1), killed_at + 2)}
    keep |= set(range(stride, steps + 1, stride))
    return sorted(s for s in keep if 1 <= s <= steps)


def combined_curve(first: Launch, resumed: Launch) -> dict[int, float]:
    """The killed run's curve: its first launch up to the restored step, then the resume."""
    restored = resumed.restored or 0
    curve = {s: v for s, v in first.losses.items() if s <= restored}
    curve.update(resumed.losses)
    return curve


def _note(step: int, save_every: int, restored: int, killed_at: int) -> str:
    if step == killed_at:
        return "[red]<- SIGKILL[/]"
    if step == restored:
        return "[cyan]<- restored[/]"
    if restored < step < killed_at:
        return "[yellow]lost, redone[/]"
    if step % save_every == 0 and step < killed_at:
        return "[dim]saved[/]"
    return ""


def _fmt(loss: float | None) -> str:
    return "-" if loss is None else repr(loss)


# --- the optional plot -----------------------------------------------------------------


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plot(
    path: Path, args: argparse.Namespace, ref: Launch, first: Launch, resumed: Launch
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = sorted(ref.losses)
    ax.plot(steps, [ref.losses[s] for s in steps], lw=3, alpha=0.4, label="uninterrupted")
    pre = sorted(first.losses)
    ax.plot(pre, [first.losses[s] for s in pre], "x", color="C3", label="killed run")
    post = sorted(resumed.losses)
    ax.plot(post, [resumed.losses[s] for s in post], ".", color="C2", label="resumed run")
    ax.axvline(first.last_step, color="C3", ls="--", lw=1, label="SIGKILL")
    if resumed.restored is not None:
        ax.axvline(resumed.restored, color="C0", ls=":", lw=1, label="restored checkpoint")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"unbroken demo: {args.steps} steps, killed after step {first.last_step}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
