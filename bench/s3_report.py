"""The table and the RESULT json of bench/s3.py, from the samples its ranks recorded."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from typing import Any

from common import MIB, new_table, show
from s3_methods import MODES, SMALL, S3Config

# unbroken save and restore, as a fraction of the raw parallel PUT and GET
TARGET_OF_LIMIT = {"save": 0.95, "restore": 0.9}


def fmt(x: float) -> str:
    return f"{x:.2f}"


def paired(samples: dict[str, list[float]], key: str, base: str) -> float:
    """The median over repeats of ``key``'s speed over ``base``'s in the same repeat: the
    server's speed drifts during a run (its garbage collection, the ranks' page cache), and
    a sample divided by one taken beside it cancels the drift that best-of-each would not."""
    return statistics.median(a / b for a, b in zip(samples[key], samples[base], strict=True))


def row(*cells: str, fetched: str = "", target: str = "") -> tuple[str, ...]:
    """A table row: method, op, GiB/s, median, of raw, vs boto3 (the missing ones blank),
    fetched, target."""
    return (*cells, *[""] * (6 - len(cells)), fetched, target)


def report(
    cfg: S3Config, raw: dict[str, Any], server_note: str, others: dict[str, float]
) -> dict[str, Any]:
    """Print the table; return the RESULT json."""
    samples: dict[str, list[float]] = raw["samples"]
    best = {k: max(v) for k, v in samples.items()}
    median = {k: statistics.median(v) for k, v in samples.items()}
    connector = raw["connector"]
    limit = {"save": best["raw_put"], "restore": best["raw_get"]}
    rows: list[tuple[str, ...]] = []
    fraction: dict[str, float] = {}
    vs_boto3: dict[str, float] = {}
    passed: dict[str, bool] = {}

    small_get_ms = statistics.median(raw["small_get_ms"])
    put = fmt(best["raw_put"]), fmt(median["raw_put"])
    rows.append(row("limit: obstore, parallel", "PUT", *put))
    latency = f"one {SMALL // 1024} KiB GET: {small_get_ms:.1f} ms (median)"
    rows.append(row("", "GET", fmt(best["raw_get"]), fmt(median["raw_get"]), target=latency))
    ours = len(rows)  # unbroken's save and restore rows come next
    rows += method_rows(cfg, connector, samples, fraction, vs_boto3, passed)
    for at, op in ((ours, "save"), (ours + 1, "restore")):
        cell = requests_cell(raw["requests"].get(op, {}))
        rows[at] = (*rows[at][:6], cell, rows[at][7])
    fetched: dict[str, int] = {}
    rows += replicated_rows(cfg, raw["fetched_bytes"], best, median, fetched)

    print_table(cfg, rows, server_note, others)
    stored = cfg.replicated_bytes
    return {
        "config": public(asdict(cfg)) | {"total_bytes": cfg.total_bytes},
        "server": server_note,
        "statistic": "best of repeats",
        "fraction_statistic": "median over repeats of the ratio to the same repeat's sample",
        "gib_per_s": best,
        "median_gib_per_s": median,
        "samples": samples,
        "limits": limit,
        "small_get_ms": {"bytes": SMALL, "median": small_get_ms, "samples": raw["small_get_ms"]},
        "fraction_of_limit": fraction,
        "vs_boto3": vs_boto3,
        "targets": {"of_limit": TARGET_OF_LIMIT},
        "passed": passed,
        "connector": connector,
        "requests_per_save": raw["requests"].get("save", {}),
        "requests_per_restore": raw["requests"].get("restore", {}),
        "versions": versions(),
        "other_processes_cpu": others,
        "replicated": {
            "stored_bytes": stored,
            "held_bytes": cfg.ranks * stored,
            "fetched_bytes": fetched,
            "fetched_per_stored": {m: b / stored for m, b in fetched.items()},
        },
    }


def method_rows(
    cfg: S3Config,
    connector: dict[str, Any],
    samples: dict[str, list[float]],
    fraction: dict[str, float],
    vs_boto3: dict[str, float],
    passed: dict[str, bool],
) -> list[tuple[str, ...]]:
    """A save and a restore row per method; their fractions of the raw limit, ratios to
    boto3 (both `paired`) and unbroken's pass/fail go into ``fraction``, ``vs_boto3`` and
    ``passed``."""
    best = {k: max(v) for k, v in samples.items()}
    median = {k: statistics.median(v) for k, v in samples.items()}
    rows: list[tuple[str, ...]] = []
    dcp_label = "s3torchconnector DCP"
    if connector.get("save_on") not in (None, cfg.server.kind):
        dcp_label += f" (on {connector['save_on']})"
    methods = [
        ("unbroken", "unbroken"),
        ("torch.save + boto3", "boto3"),
        (dcp_label, "dcp"),
    ]
    for label, name in methods:
        for i, op in enumerate(("save", "restore")):
            key = f"{name}_{op}"
            note = ""
            if key not in best:
                why = connector["errors"]
                note = "; ".join(f"{where}: {text}" for where, text in why.items())
                rows.append(row(label if i == 0 else "", op, "n/a", "n/a", target=note))
                continue
            fraction[key] = paired(samples, key, "raw_put" if op == "save" else "raw_get")
            if "boto3_" + op in best:
                vs_boto3[key] = paired(samples, key, "boto3_" + op)
            if name == "unbroken":
                ok = passed[key] = fraction[key] >= TARGET_OF_LIMIT[op]
                note = (
                    f"{'PASS' if ok else 'FAIL'}: {fraction[key]:.1%} of raw (need "
                    f"{TARGET_OF_LIMIT[op]:.0%})"
                )
            elif name == "dcp" and op == "restore" and connector.get("restore_source"):
                note = f"checkpoint written by DCP {connector['restore_source']} (untimed)"
            elif name == "dcp" and connector["errors"]:
                note = "; ".join(f"{w}: {t}" for w, t in connector["errors"].items())
            ratio = f"{vs_boto3[key]:.2f}x" if key in vs_boto3 else ""
            figures = fmt(best[key]), fmt(median[key]), f"{fraction[key]:.0%}", ratio
            rows.append(row(label if i == 0 else "", op, *figures, target=note))
    return rows


def replicated_rows(
    cfg: S3Config,
    fetched_bytes: dict[str, list[int]],
    best: dict[str, float],
    median: dict[str, float],
    fetched: dict[str, int],
) -> list[tuple[str, ...]]:
    """The replicated state's save and its restore per read mode; the most bytes a
    restore fetched, per mode, go into ``fetched``."""
    stored = cfg.replicated_bytes
    label = f"unbroken, replicated {cfg.replicated_mib} MiB"
    saved = fmt(best["replicated_save"]), fmt(median["replicated_save"])
    rows = [row(label, "save (stored once)", *saved)]
    for mode in MODES:
        key = f"replicated_restore_{mode}"
        counts = fetched_bytes[mode]
        fetched[mode] = max(counts)
        times = fetched[mode] / stored
        got = f"{fetched[mode] / MIB:,.0f} MiB ({times:.2f}x)"
        rows.append(row("", f"restore, {mode}", fmt(best[key]), fmt(median[key]), fetched=got))
    return rows


def requests_cell(counts: dict[str, int]) -> str:
    """``N requests (GET a, PUT b...)``: all ranks' HTTP requests for one save or restore."""
    detail = ", ".join(f"{m} {n}" for m, n in sorted(counts.items()))
    return f"{sum(counts.values())} requests ({detail})" if counts else ""


def public(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without credentials (a server of the user's may be behind them)."""
    for server in (config["server"], config["moto"]):
        if server is not None:
            server["access_key"] = server["secret_key"] = "***"
    return config


def print_table(
    cfg: S3Config, rows: list[tuple[str, ...]], server_note: str, others: dict[str, float]
) -> None:
    from rich.markup import escape

    table = new_table(
        f"S3: {cfg.ranks} ranks x {cfg.mib_per_rank} MiB, {cfg.repeats} repeats, {server_note}",
        "aggregate GiB/s (all ranks' bytes / slowest rank), best and median of repeats; "
        "'of raw' = % of obstore's PUT (saves) or GET (restores), and 'vs boto3' = x torch.save + "
        "boto3: the median over repeats of each repeat's ratio (unbroken and the raw limit run "
        "back to back, who goes first alternating, each on an emptied server; an untimed "
        "warm-up round first); "
        "replicated restores: GiB/s of "
        "the bytes all ranks hold, 'fetched' = bytes GET from storage (x the stored size); "
        "requests: all ranks' HTTP requests for one unbroken save or restore, by method"
        + (
            f"; the server runs on this {os.cpu_count()}-core VM and shares its CPUs with the ranks"
            if cfg.server.kind != "external"
            else ""
        )
        + f"; other processes{' (the server among them)' if cfg.server.kind == 'external' else ''}"
        f" took {others['cores']:.2f} cores on average during the run",
        [
            ("method", "left"),
            ("op", "left"),
            ("GiB/s", "right"),
            ("median", "right"),
            ("of raw", "right"),
            ("vs boto3", "right"),
            ("fetched / requests", "right"),
            ("target", "left"),
        ],
    )
    for cells in rows:
        table.add_row(*map(escape, cells))  # error texts may hold [brackets]
    show(160, table)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "obstore", "boto3", "s3torchconnector", "moto"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out
