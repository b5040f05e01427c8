"""`unbroken goodput`'s printed report: goodput, badput by cause, failures. The HTML
report (`unbroken.goodput.html`) shows the very same strings (`figures`)."""

from __future__ import annotations

from unbroken.goodput.account import CAUSES, Account

COLOURS = {
    "productive": "#2e7d32",
    "checkpoint": "#f9a825",
    "detection": "#c62828",
    "restart": "#ef6c00",
    "init": "#6a1b9a",
    "restore": "#1565c0",
    "recompute": "#ad1457",
    "data": "#00838f",
    "other": "#bdbdbd",
}


def pct(seconds: float, wall: float) -> str:
    return f"{100 * seconds / wall:.2f} %" if wall > 0 else "-"


def figures(a: Account) -> list[tuple[str, str, str, str]]:
    """(key, what, seconds, share) rows: productive first, then each cause of badput,
    largest first, then the total."""
    rows = [
        (
            "productive",
            "productive training",
            f"{a.seconds['productive']:.2f}",
            pct(a.seconds["productive"], a.wall_s),
        )
    ]
    for key in sorted(CAUSES, key=lambda k: -a.seconds[k]):
        rows.append((key, CAUSES[key], f"{a.seconds[key]:.2f}", pct(a.seconds[key], a.wall_s)))
    rows.append(("wall", "wall clock (mean over ranks)", f"{a.wall_s:.2f}", "100.00 %"))
    return rows


def text(a: Account, where: str) -> str:
    """The printed report."""
    lines = [
        f"goodput of {where}: {pct(a.seconds['productive'], a.wall_s)} "
        f"({len(a.ranks)} rank(s), {a.wall_s:.2f} s, {len(a.failures)} failure(s), "
        f"{a.steps_recomputed} step(s) recomputed)",
        "",
        f"  {'':<30} {'seconds':>10} {'share':>9}",
    ]
    for _, what, seconds, share in figures(a):
        lines.append(f"  {what:<30} {seconds:>10} {share:>9}")
    lines.append(
        f"\n  background persists: {a.persist_s:.2f} s per rank, overlapped with "
        "training (not badput)"
    )
    for f in a.failures:
        seen = "not seen" if f["detected_t"] is None else f"detected at {f['detected_t']:.2f} s"
        lines.append(f"  failure at {f['t']:.2f} s: {f['what']} (step {f['step']}), {seen}")
    return "\n".join(lines)
