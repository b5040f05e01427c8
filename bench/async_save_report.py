"""The tables and the RESULT json of bench/async_save.py, from the samples its ranks
recorded (seconds, or fractions for slowdowns) and the memory runs' rows."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from async_save_run import LABELS, TRAINED
from common import GIB, MIB, TARGET_OF_LIMIT, DiskConfig, new_table, show
from limits import STREAMS

TARGET_VS_MEMCPY = 1.5  # blocking time at most this multiple of the memcpy limit
TARGET_VS_DCP = 1 / 3  # ... and at most this fraction of DCP's blocking time
TARGET_FIRST = 1.5  # the first save's blocking time, as a multiple of a later one's
TARGET_RSS = 2.2  # peak memory per rank, in state sizes (state + one staging copy + slack)
WRITERS = ("write_fsync", "write_fsync_early", "write_fsync_striped", "write_direct_striped")
LIMITS = ("block.memcpy", "block.memcpy_fresh", *(f"durable.{w}" for w in WRITERS))
Row = tuple[str, ...]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def steady(key: str, values: list[float]) -> list[float]:
    """A method's saves after the first (which allocates); every sample of the rest."""
    is_save = key.startswith(("block.", "durable.")) and key not in LIMITS
    return values[1:] if is_save else values


@dataclass
class Figures:
    """The statistics of one run, and the pass/fail checks the rows find on the way."""

    cfg: DiskConfig
    samples: dict[str, list[float]]
    unavailable: dict[str, str]
    checks: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        samples = self.samples
        self.methods = [m for m in LABELS if m not in self.unavailable]
        self.gib = self.cfg.total_bytes / GIB
        self.first = {k: v[0] for k, v in samples.items()}
        # least time, least slowdown
        self.best = {k: min(steady(k, v)) for k, v in samples.items()}
        self.median = {k: statistics.median(steady(k, v)) for k, v in samples.items()}
        self.memcpy = self.best["block.memcpy"]
        best = self.best
        # the fastest raw writer's best sample, striped over files included (see
        # common.STREAMS): an upper bound, held against a method's median, so that one
        # burst of this VM's disk cannot make a method's figure
        self.write_limit = min(best[f"durable.{w}"] for w in WRITERS)
        # against the faster DCP mode that ran: the stricter comparison
        dcps = [m for m in self.methods if m.startswith("dcp")]
        self.dcp_first = min(self.first[f"block.{m}"] for m in dcps)
        self.dcp_steady = min(best[f"block.{m}"] for m in dcps)

    def ms(self, key: str, pick: dict[str, float]) -> str:
        return f"{pick[key] * 1e3:.1f}"

    def rate(self, key: str, pick: dict[str, float]) -> str:
        return f"{self.gib / pick[key]:.2f}"

    def summary(self, key: str, scale: Callable[[float], float]) -> dict[str, float]:
        out = {"best": scale(self.best[key]), "median": scale(self.median[key])}
        return out if key in LIMITS else {"first": scale(self.first[key])} | out


def blocking_rows(f: Figures) -> list[Row]:
    speed: list[Row] = []
    best, median, first, memcpy = f.best, f.median, f.first, f.memcpy
    for key, label in (
        ("memcpy", "limit: memcpy, touched buffer"),
        ("memcpy_fresh", "memcpy, fresh memory"),
    ):
        key = f"block.{key}"
        ratio = f"{best[key] / memcpy:.1f}x"
        speed.append(("blocking, ms", label, "", f.ms(key, best), f.ms(key, median), ratio, ""))
    for m, label in LABELS.items():
        key = f"block.{m}"
        if m in f.unavailable:
            speed.append(("blocking, ms", label, "n/a", "n/a", "n/a", "", f.unavailable[m][:70]))
            continue
        lines = []
        if m == "unbroken":
            for when, value, dcp_value in (
                ("first", first[key], f.dcp_first),
                ("steady", best[key], f.dcp_steady),
            ):
                vs_memcpy, vs_dcp = value / memcpy, value / dcp_value
                f.checks[f"blocking_{when}"] = ok = (
                    vs_memcpy <= TARGET_VS_MEMCPY and vs_dcp <= TARGET_VS_DCP
                )
                lines.append(
                    f"{verdict(ok)} {when}: {vs_memcpy:.2f}x memcpy (<= {TARGET_VS_MEMCPY:g}x), "
                    f"{vs_dcp:.2f}x DCP (<= {TARGET_VS_DCP:.2f}x)"
                )
            f.checks["first_vs_steady"] = ok = first[key] <= TARGET_FIRST * best[key]
            lines.append(
                f"{verdict(ok)} first: {first[key] / best[key]:.2f}x steady (<= {TARGET_FIRST:g}x; "
                "staging prepared ahead)"
            )
            # what bounds them: memcpy is as fast as a copy gets; fresh memory faults pages in
            lines.append(
                f"(memcpy is {memcpy / f.dcp_steady:.2f}x DCP steady; first is "
                f"{first[key] / best['block.memcpy_fresh']:.1f}x the best fresh memcpy)"
            )
        figures = f.ms(key, first), f.ms(key, best), f.ms(key, median), f"{best[key] / memcpy:.1f}x"
        speed.append(("blocking, ms", label, *figures, "\n".join(lines)))
    return speed


def durable_rows(f: Figures, of_limit: dict[str, float]) -> list[Row]:
    """The durable rows; each method's fraction of the write limit goes into ``of_limit``."""
    speed: list[Row] = []
    best, median, first = f.best, f.median, f.first
    for key, label in (
        ("write_fsync", "limit: write + fsync"),
        ("write_fsync_early", "limit: write + fsync, early writeback"),
        ("write_fsync_striped", f"limit: write + fsync, {STREAMS} files in parallel"),
        ("write_direct_striped", f"limit: O_DIRECT write + fsync, {STREAMS} files"),
    ):
        key = f"durable.{key}"
        speed.append(("durable, GiB/s", label, "", f.rate(key, best), f.rate(key, median), "", ""))
    for m in f.methods:
        key = f"durable.{m}"
        of_limit[m] = f.write_limit / median[key]
        target = ""
        if m == "unbroken":
            f.checks["durable"] = ok = of_limit[m] >= TARGET_OF_LIMIT
            target = f"{verdict(ok)}: {of_limit[m]:.0%} of write (>= {TARGET_OF_LIMIT:.0%})"
        rates = f.rate(key, first), f.rate(key, best), f.rate(key, median), f"{of_limit[m]:.0%}"
        speed.append(("durable, GiB/s", LABELS[m], *rates, target))
    return speed


def training_rows(f: Figures) -> list[Row]:
    best, median = f.best, f.median
    step = f"{best['step_ms']:.2f}", f"{median['step_ms']:.2f}"
    speed: list[Row] = [("training step, ms", "no save running", "", *step, "", "")]
    for m in TRAINED:
        key = f"slowdown.{m}"
        slowdowns = f"{best[key]:+.0%}", f"{median[key]:+.0%}"
        speed.append(("step slowdown, persisting", LABELS[m], "", *slowdowns, "", ""))
    for m in TRAINED:
        key = f"lost.{m}"
        lost = f"{best[key] * 1e3:.0f}", f"{median[key] * 1e3:.0f}"
        speed.append(("training lost per save, ms", LABELS[m], "", *lost, "", ""))
    return speed


def memory_rows(
    f: Figures, memory: dict[str, list[dict[str, Any]]], rss: dict[str, dict[str, Any]]
) -> list[Row]:
    """The peak-RSS rows; each method's figures go into ``rss``."""
    mem_rows: list[Row] = []
    for m, rows in memory.items():
        # per rank, in state sizes; "added" leaves out what the process held before the state
        rss[m] = {
            "state_mib": max(r["state"] for r in rows) / MIB,
            "baseline_mib": max(r["baseline"] for r in rows) / MIB,
            "added_first": max((r["peak_first"] - r["baseline"]) / r["state"] for r in rows),
            "added": max((r["peak"] - r["baseline"]) / r["state"] for r in rows),
            "raw": max(r["peak"] / r["state"] for r in rows),
            "restored": all(r["restored"] for r in rows),
        }
        target = ""
        if m == "unbroken":
            f.checks["rss"] = ok = rss[m]["added"] <= TARGET_RSS
            f.checks["restore"] = rss[m]["restored"]
            target = f"{verdict(ok)}: added <= {TARGET_RSS:g}x"
        mem_rows.append(
            (
                LABELS[m],
                f"{rss[m]['state_mib']:.0f}",
                f"{rss[m]['baseline_mib']:.0f}",
                f"{rss[m]['added_first']:.2f}x",
                f"{rss[m]['added']:.2f}x",
                f"{rss[m]['raw']:.2f}x",
                verdict(rss[m]["restored"]),
                target,
            )
        )
    return mem_rows


def report(
    cfg: DiskConfig, raw: dict[str, Any], memory: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Print both tables; return the RESULT json."""
    f = Figures(cfg, raw["samples"], raw["unavailable"])
    of_limit: dict[str, float] = {}
    speed = blocking_rows(f) + durable_rows(f, of_limit) + training_rows(f)
    rss: dict[str, dict[str, Any]] = {}
    mem_rows = memory_rows(f, memory, rss)
    print_tables(cfg, speed, mem_rows)
    return result(f, of_limit, rss)


def result(f: Figures, of_limit: dict[str, float], rss: dict[str, Any]) -> dict[str, Any]:
    best, median, gib = f.best, f.median, f.gib

    def to_ms(s: float) -> float:
        return s * 1e3

    def to_rate(s: float) -> float:
        return gib / s

    return {
        "config": asdict(f.cfg) | {"total_bytes": f.cfg.total_bytes},
        "statistic": "first call; best and median of the later calls (limits: of all); "
        "durable fractions: medians over the limit's best",
        "unavailable": f.unavailable,
        "blocking_ms": {
            m: f.summary(f"block.{m}", to_ms) for m in ("memcpy", "memcpy_fresh", *f.methods)
        },
        "durable_gib_per_s": {
            m: f.summary(f"durable.{m}", to_rate) for m in (*WRITERS, *f.methods)
        },
        "limits": {"memcpy_ms": f.memcpy * 1e3, "write_gib_per_s": gib / f.write_limit},
        "memcpy_vs_dcp_steady": f.memcpy / f.dcp_steady,
        "durable_of_write_limit": of_limit,
        "train_step_ms": {"best": best["step_ms"], "median": median["step_ms"]},
        "slowdown": {
            m: {"best": best[f"slowdown.{m}"], "median": median[f"slowdown.{m}"]} for m in TRAINED
        },
        "training_lost_ms_per_save": {
            m: {"best": best[f"lost.{m}"] * 1e3, "median": median[f"lost.{m}"] * 1e3}
            for m in TRAINED
        },
        "memory_per_rank_over_state": rss,
        "samples": f.samples,
        "targets": {
            "blocking_vs_memcpy": TARGET_VS_MEMCPY,
            "blocking_vs_dcp": TARGET_VS_DCP,
            "first_vs_steady": TARGET_FIRST,
            "rss_added_over_state": TARGET_RSS,
            "durable_of_write_limit": TARGET_OF_LIMIT,
        },
        "pass": f.checks,
    }


def print_tables(cfg: DiskConfig, speed: list[Row], memory: list[Row]) -> None:
    left = ("measure", "method", "target")
    table = new_table(
        f"{cfg.ranks} ranks x {cfg.mib_per_rank} MiB, {cfg.repeats} repeats, {cfg.dir}",
        "slowest rank; first = first call (3 s after Checkpointer.prepare, as after a script's "
        "first steps), best/median = later calls; blocking: until save returns; durable: until "
        "committed (fsynced), aggregate GiB/s, 'vs limit' the median over the fastest raw "
        "writer's best; slowdown: mean step time while a save persists vs none just before; "
        "lost: step time beyond that baseline, summed over the save. 2 ranks train on 2 cores: "
        "a save's threads and the kernel's page-cache work can only take cycles from training",
        [
            (name, "left" if name in left else "right")
            for name in ("measure", "method", "first", "best", "median", "vs limit", "target")
        ],
    )
    for i, row in enumerate(speed):
        if i and row[0] != speed[i - 1][0]:
            table.add_section()
        table.add_row(*row)

    names = ("method", "state MiB", "before MiB", "added, 1 save", "added, 2 saves", "raw")
    rss = new_table(
        "peak RSS per rank, a fresh process per method, two saves",
        "added = (VmHWM - RSS before the state existed) / state size; raw = VmHWM / "
        "state size; restore: every tensor changed right after save returned, both steps "
        "restored into zeroed tensors and equal to the state as saved",
        [
            (name, "left" if name in ("method", "target") else "right")
            for name in (*names, "restore", "target")
        ],
    )
    for row in memory:
        rss.add_row(*row)
    show(175, table, rss)
