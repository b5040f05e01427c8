"""The demo's three launches as data, and what is made of them: the step-by-step
comparison (bitwise), the table and verdict, and the optional plot."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

VERDICT_EQUAL = "EQUAL"
VERDICT_DIFFERENT = "DIFFERENT"


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
    started_at: float = 0.0  # wall clock, seconds since the epoch
    log: list[str] = field(default_factory=list)  # every line that was not an event

    @property
    def last_step(self) -> int:
        return max(self.losses, default=0)


# --- the report ------------------------------------------------------------------------


def report(
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


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: Path, args: argparse.Namespace, ref: Launch, first: Launch, resumed: Launch) -> None:
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
