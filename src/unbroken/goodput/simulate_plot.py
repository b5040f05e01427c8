"""``unbroken simulate --plot``: goodput against the checkpoint interval, per strategy,
with the interval `unbroken.policies.young_daly` (the ``auto`` policy) picks marked."""

from __future__ import annotations

from pathlib import Path

from unbroken.goodput.costs import Cluster, Costs
from unbroken.goodput.plot import save_png
from unbroken.goodput.simulate import simulate
from unbroken.policies import young_daly

COLOURS = {"traditional": "#c62828", "checkpointless": "#2e7d32"}


def curve(
    costs: Costs, cluster: Cluster, intervals: list[float], days: float, seeds: int
) -> list[float]:
    out = []
    for every in intervals:
        runs = [
            simulate(costs, every, cluster.mtbf_s, days * 86400, cluster.mix, seed=s)
            for s in range(seeds)
        ]
        out.append(100 * sum(r.goodput for r in runs) / seeds)
    return out


def plot(path: Path, cluster: Cluster, costs: list[Costs], days: float, seeds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for c in costs:
        chosen = young_daly(c.stall, cluster.mtbf_s)
        intervals = [chosen * 2 ** (k / 2) for k in range(-8, 9)]
        goodput = curve(c, cluster, intervals, days, seeds)
        colour = COLOURS.get(c.strategy, "black")
        ax.plot(intervals, goodput, marker=".", color=colour, label=c.strategy)
        (at,) = curve(c, cluster, [chosen], days, seeds)
        ax.plot(
            [chosen],
            [at],
            marker="*",
            markersize=14,
            color=colour,
            linestyle="none",
            label=f"young_daly: {chosen:.0f} s, {at:.2f} %",
        )
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval, seconds of training (log)")
    ax.set_ylabel("goodput, %")
    ax.set_title(
        f"{cluster.gpus} GPUs, GPU MTBF {cluster.gpu_mtbf_hours:g} h, "
        f"{cluster.state_gb_per_gpu:g} GB/GPU, {days:g} days x {seeds} runs per point",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
