"""The PNG timeline of `unbroken goodput` (matplotlib, the ``plot`` extra): one bar per
rank, coloured by where each second went, failures marked."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from unbroken.access import Access
from unbroken.goodput.account import CAUSES, Account
from unbroken.goodput.report import COLOURS, pct


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def save_png(fig: Any, path: Path) -> None:
    """``fig`` as the PNG ``path``, with `Access.from_env`'s file mode whatever the umask
    (0600: a run's timeline is its user's, as its event logs are)."""
    fd = Access.from_env().open(str(path), os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        fig.savefig(f, format="png", dpi=120)


def timeline(a: Account, where: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(12, max(2.8, 1.4 + 0.4 * len(a.ranks))))
    for row, rank in enumerate(a.ranks):
        for label in COLOURS:
            bars = [(s, e - s) for s, e, k in a.segments[rank] if k == label]
            ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=COLOURS[label])
    for i, f in enumerate(a.failures):
        ax.axvline(f["t"], color="black", linestyle="--", linewidth=1)
        ax.text(
            f["t"],
            1.02 + 0.07 * (i % 2),
            f" {f['what']}",
            fontsize=8,
            transform=ax.get_xaxis_transform(),
        )
    ax.set_yticks(range(len(a.ranks)), [f"rank {r}" for r in a.ranks])
    ax.set_ylim(len(a.ranks) - 0.5, -0.5)
    ax.set_xlim(0, a.wall_s)
    ax.set_xlabel("seconds since launch")
    names = {"productive": "productive", **CAUSES}
    handles = [
        Patch(color=COLOURS[k], label=f"{names[k]} {pct(a.seconds[k], a.wall_s)}")
        for k in COLOURS
        if a.seconds[k] > 0
    ]
    ax.legend(
        handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False
    )
    ax.set_title(
        f"goodput {pct(a.seconds['productive'], a.wall_s)}: {where}",
        fontsize=10,
        pad=26 if a.failures else 6,
    )
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
