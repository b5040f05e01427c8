# mypy: disallow-untyped-defs
"""The table and RESULT json of bench/reshard.py."""

from __future__ import annotations

import statistics
from typing import Any

from common import TARGET_OF_LIMIT, new_table, show

COLUMNS = ("ranks", "storage", "method", "GiB/s", "median", "of limit", "target")


def report(title: str, runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Print the table of every restoring world's samples; return the RESULT json."""
    caption = (
        "GiB/s: the state's bytes / slowest rank; best of repeats (median beside); local reads "
        "cold; limit: the same byte ranges read raw with the same parallelism"
    )
    numeric = ("GiB/s", "median", "of limit")
    table = new_table(title, caption, [(c, "right" if c in numeric else "left") for c in COLUMNS])
    result: dict[str, Any] = {"statistic": "best of repeats", "runs": {}}
    fraction: dict[str, float] = {}
    for world, raw in runs.items():
        best = {k: max(v) for k, v in raw["samples"].items()}
        median = {k: statistics.median(v) for k, v in raw["samples"].items()}
        met: dict[str, bool] = {}
        for storage in ("local", "s3"):
            limit = best.get(f"{storage} limit")
            if limit is None:
                continue
            for method in ("limit", "unbroken", "DCP"):
                figures = _figures(f"{storage} {method}", best, median, limit)
                target = _target(storage, method, best, limit, met)
                table.add_row(str(world), storage, method, *figures, target)
                if method != "limit" and f"{storage} {method}" in best:
                    fraction[f"{world} ranks {storage} {method}"] = (
                        best[f"{storage} {method}"] / limit
                    )
        result["runs"][str(world)] = {
            "gib_per_s": best,
            "median_gib_per_s": median,
            "samples": raw["samples"],
            "targets_met": met,
            "residency_after_evict": raw["residency"],
        }
    result["targets_met"] = all(
        m for r in result["runs"].values() for m in r["targets_met"].values()
    )
    result["fraction_of_limit"] = fraction
    show(150, table)
    return result


def _figures(key: str, best: dict[str, float], median: dict[str, float], limit: float) -> list[str]:
    if key not in best:
        return [
            "n/a",
            "",
            "",
        ]
    return [f"{best[key]:.2f}", f"{median[key]:.2f}", f"{best[key] / limit:.0%}"]


def _target(
    storage: str, method: str, best: dict[str, float], limit: float, met: dict[str, bool]
) -> str:
    if method == "DCP" and storage == "s3":
        return "FileSystemReader reads local files only"
    if method != "unbroken":
        return ""
    ours = best[f"{storage} unbroken"]
    dcp_speed = best.get(f"{storage} DCP")
    ok = ours >= TARGET_OF_LIMIT * limit and (dcp_speed is None or ours > dcp_speed)
    met[storage] = ok
    vs = "" if dcp_speed is None else f", {ours / dcp_speed:.2f}x DCP (> 1x)"
    return f"{'PASS' if ok else 'FAIL'}: {ours / limit:.0%} of limit (>= {TARGET_OF_LIMIT:.0%}){vs}"
