"""What the default silent-data-corruption check (`unbroken.sdc`) costs a DDP job: the same
saves of a 2-rank gloo DDP model and its Adam state with the check on (the default) and off
(``Replicated(auto=False)``), interleaved in one run, next to the most any check of the
replicated state could add on this machine.

    python bench/sdc_cost.py                       # 2 ranks x 256 MiB of parameters, 7 repeats
    python bench/sdc_cost.py --smoke               # 8 MiB, 2 repeats: seconds (CI)

What the check does beyond a save without it: a walk of the DDP modules' parameters and the
optimizers' groups in the caller's thread (`sdc.known`), a list of indices in the message each
rank sends the planner, and one pass over the gathered checksums on rank 0
(`Replicated.divergent`). It hashes nothing: every rank hashes the blocks another rank holds
too before the plan whether the check is on or not (the plan writes a replicated block once,
by checksum). The limit row is what a check that had to hash for itself would add: every
rank hashing its replicated bytes once with the format's checksum on the save's IO threads,
and the digests gathered; the check's own two steps are also timed alone.

Both Checkpointers are created and prepared before any timing (staging touched ahead); the
methods rotate their order each repeat, with the disk flushed and a pause between them.
Times are the slowest rank's; on - off is the median of the per-repeat differences.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unbroken
from common import (
    GIB,
    MIB,
    PAUSE_S,
    DiskConfig,
    Justify,
    disk_workdir,
    free_port,
    hand_back,
    join_gloo,
    leave_group,
    max_over_ranks,
    new_table,
    print_result,
    read_back,
    rotated,
    run_ranks,
    settle,
    show,
    timed,
)
from unbroken.format.blockio import run_all
from unbroken.format.layout import block_checksums
from unbroken.format.shards import byte_view
from unbroken.format.write_plan import Block
from unbroken.sdc import Replicated, report

WIDTH = 1024  # Linear(WIDTH, WIDTH): 4 MiB of fp32 weight per layer
IO_THREADS = 2  # Checkpointer's default, and the limit's hashing threads
WAIT_S = 300.0  # longest wait for a save; a hang fails the run instead
PREPARED_S = 3.0  # first timed save this long after `prepare` (as bench/async_save_run.py)
WORK_REPEATS = 20  # in-process samples of the check's own steps
SAVES = {  # method -> (blocking, SDC check on)
    "async_on": (False, True),
    "async_off": (False, False),
    "blocking_on": (True, True),
    "blocking_off": (True, False),
}
LABELS = {
    "async_on": "save(blocking=False), check on (default)",
    "async_off": "save(blocking=False), Replicated(auto=False)",
    "blocking_on": "save(blocking=True), check on (default)",
    "blocking_off": "save(blocking=True), Replicated(auto=False)",
}


# --------------------------------------------------------------------------- the job


def make_model(mib: int) -> nn.Module:
    """About ``mib`` MiB of fp32 parameters, the same on every rank (seeded)."""
    per_layer = (WIDTH * WIDTH + WIDTH) * 4
    torch.manual_seed(0)
    layers = max(1, round(mib * MIB / per_layer))
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers))
    )


def train_step(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
    """One DDP step on this rank's own batch: gradients all-reduced, Adam state created."""
    gen = torch.Generator().manual_seed(rank)
    loss = model(torch.randn(8, WIDTH, generator=gen)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def replicated_tensors(module: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What DDP keeps equal on every rank: the parameters and their optimizer state."""
    out: list[torch.Tensor] = [*module.parameters()]
    for p in module.parameters():
        out += [v for v in optim.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def hash_and_gather(tensors: list[torch.Tensor]) -> None:
    """The limit: the format's checksums of ``tensors`` on the save's IO threads (as a save
    hashes), then every rank's digests gathered, as a check would compare them."""
    sums: dict[int, str] = {}

    def one(i: int) -> None:
        sums[i] = block_checksums(byte_view(tensors[i])).xxh3

    run_all(one, range(len(tensors)), max(2, IO_THREADS))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)


def sample(fn: Callable[[], object]) -> list[float]:
    """``fn`` timed alone in this process, `WORK_REPEATS` times."""
    out = []
    for _ in range(WORK_REPEATS):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


# --------------------------------------------------------------------------- one rank


class SdcRank:
    """One rank: a DDP model and Adam after a step, two Checkpointers (check on, off)."""

    def __init__(self, rank: int, cfg: DiskConfig) -> None:
        self.rank, self.cfg, self.root = rank, cfg, Path(cfg.dir)
        self.model = DistributedDataParallel(make_model(cfg.mib_per_rank))
        self.optim = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        train_step(self.model, self.optim, rank)
        self.state: dict[str, Any] = {"model": self.model, "optim": self.optim}
        self.replicated = replicated_tensors(self.model.module, self.optim)
        self.ckpts = {
            on: unbroken.Checkpointer(
                self.root / ("on" if on else "off"),
                io_threads=IO_THREADS,
                replicated=None if on else Replicated(auto=False),
            )
            for on in (True, False)
        }
        for ckpt in self.ckpts.values():
            ckpt.prepare(self.state)  # staging touched ahead, as a training script does
        prepared_at = time.monotonic()
        self.steps = itertools.count(1000)
        self.samples: dict[str, list[float]] = {}
        self.check_work()
        # pauses in proportion to the state (the full ones from about 256 MiB of parameters)
        self.scale = min(1.0, 3 * cfg.mib_per_rank * MIB / GIB)
        time.sleep(max(0.0, PREPARED_S * self.scale - (time.monotonic() - prepared_at)))

    def record(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def check_work(self) -> None:
        """The check's own steps, timed alone: the walk a save runs in the caller's thread,
        and the compare pass rank 0 runs over every rank's gathered checksums."""
        default, wrappers = Replicated(), {"model": self.model}
        known = default.known(self.state, wrappers)
        assert known is not None and known.keys and known.optimizer_state, "nothing known"
        self.samples["walk"] = sample(lambda: default.known(self.state, wrappers))
        blocks = [
            Block(key=f"t{i}", dtype="float32", shape=tuple(t.shape), offsets=(0,) * t.dim(),
                  local_shape=tuple(t.shape), nbytes=t.nbytes, xxh3=f"{i:016x}")
            for i, t in enumerate(self.replicated)
        ]  # fmt: skip
        world = self.cfg.ranks
        every = [list(range(len(blocks)))] * world
        self.samples["compare"] = sample(lambda: default.divergent([blocks] * world, every))
        self.compared = len(blocks), sum(t.nbytes for t in self.replicated)

    def save(self, method: str) -> None:
        blocking, on = SAVES[method]
        dist.barrier()
        begin = time.perf_counter()
        handle = self.ckpts[on].save(next(self.steps), self.state, blocking=blocking)
        blocked = time.perf_counter() - begin
        if not handle.wait(WAIT_S):
            raise AssertionError(f"{method}: the save was skipped")
        durable = time.perf_counter() - begin
        blocked, durable = max_over_ranks(blocked, durable)
        self.record(f"block.{method}", blocked)
        self.record(f"durable.{method}", durable)

    def limit(self) -> None:
        self.record("limit", timed(lambda: hash_and_gather(self.replicated)))

    def run(self) -> dict[str, Any]:
        methods: list[Callable[[], None]] = [*(partial(self.save, m) for m in SAVES), self.limit]
        folders = [self.root / "on", self.root / "off"]
        settle()
        for rep in range(self.cfg.repeats):
            for method in rotated(methods, rep):
                method()
                steps = (p for f in folders for p in f.glob("step-*"))
                settle(*steps, pause_s=PAUSE_S * self.scale)
            if self.rank == 0:
                last = ", ".join(f"{k} {v[-1] * 1e3:.0f}" for k, v in self.samples.items()
                                 if k.startswith("durable.") or k == "limit")  # fmt: skip
                print(f"repeat {rep + 1}/{self.cfg.repeats}, ms: {last}", flush=True)
        return {"samples": self.samples, "suspect": self.final_save(), "compared": self.compared}

    def final_save(self) -> bool:
        """One more default save: a healthy DDP job's step must not be marked suspect."""
        step = next(self.steps)
        self.ckpts[True].save(step, self.state)
        return self.rank == 0 and report(self.ckpts[True].storage, step) is not None


def worker(rank: int, cfg: DiskConfig) -> None:
    torch.set_num_threads(1)  # 2 ranks on 2 cores, as bench/async_save_run.py
    join_gloo(rank, cfg.ranks, cfg.port, timeout_s=300)
    bench = SdcRank(rank, cfg)
    hand_back(cfg.dir, bench.run())
    for ckpt in bench.ckpts.values():
        ckpt.close()
    leave_group()


# --------------------------------------------------------------------------- report


def stats(values: list[float]) -> dict[str, float]:
    return {"best": min(values) * 1e3, "median": statistics.median(values) * 1e3}


def summarize(cfg: DiskConfig, raw: dict[str, Any], load: dict[str, Any]) -> dict[str, Any]:
    s = raw["samples"]
    blocking = {m: stats(s[f"block.{m}"]) for m in SAVES}
    durable = {m: stats(s[f"durable.{m}"]) for m in SAVES}
    diff: dict[str, dict[str, float]] = {}
    for kind in ("async", "blocking"):
        for what in ("block", "durable"):
            on, off = s[f"{what}.{kind}_on"], s[f"{what}.{kind}_off"]
            pairs = [(a - b) * 1e3 for a, b in zip(on, off, strict=True)]
            q1, ms, q3 = statistics.quantiles(pairs, n=4)  # the middle half: the noise
            base = statistics.median(off) * 1e3
            diff[f"{what}.{kind}"] = {"ms": ms, "pct": 100 * ms / base, "q1": q1, "q3": q3}
    tensors, nbytes = raw["compared"]
    return {
        "config": {
            "ranks": cfg.ranks,
            "mib_params_per_rank": cfg.mib_per_rank,
            "repeats": cfg.repeats,
            "io_threads": IO_THREADS,
        },
        "replicated": {"tensors": tensors, "mib": nbytes / MIB},
        "blocking_ms": blocking,
        "durable_ms": durable,
        "on_minus_off": diff,
        "limit_ms": stats(s["limit"]),
        "check_ms": {"walk": stats(s["walk"]), "compare": stats(s["compare"])},
        "suspect": raw["suspect"],
        "load": load,
    }


def table(result: dict[str, Any]) -> None:
    cfg, rep, diff = result["config"], result["replicated"], result["on_minus_off"]
    title = (
        f"SDC check cost: {cfg['ranks']} ranks DDP x {cfg['mib_params_per_rank']} MiB params "
        f"+ Adam ({rep['mib']:.0f} MiB replicated, {rep['tensors']} tensors), "
        f"{cfg['repeats']} repeats"
    )
    caption = (
        "slowest rank; blocking: until save returns; durable: until committed (fsynced); "
        "on - off: median of per-repeat differences (in brackets, their middle half), % of "
        "off's median; limit: every rank "
        f"hashes its replicated bytes (xxh3, {cfg['io_threads']} threads) and the digests are "
        "gathered, an upper bound on a check that hashed for itself; the check's own work: "
        f"timed alone. Load average before/after: {result['load']['before']} / "
        f"{result['load']['after']}"
    )
    columns: list[tuple[str, Justify]] = [
        ("measure", "left"), ("method", "left"), ("best", "right"), ("median", "right"),
        ("on - off, ms", "right"), ("on - off", "right"), ("middle half, ms", "right"),
    ]  # fmt: skip
    t = new_table(title, caption, columns)
    for what, name in (("blocking_ms", "block"), ("durable_ms", "durable")):
        for m in SAVES:
            if what == "blocking_ms" and SAVES[m][0]:
                continue  # a blocking save's blocking time is its time to durable
            row = result[what][m]
            d = diff[f"{name}.{m.split('_')[0]}"] if m.endswith("_on") else None
            t.add_row(
                what.replace("_ms", ", ms"), LABELS[m], f"{row['best']:.1f}",
                f"{row['median']:.1f}", f"{d['ms']:+.1f}" if d else "",
                f"{d['pct']:+.1f}%" if d else "",
                f"[{d['q1']:+.0f}, {d['q3']:+.0f}]" if d else "",
            )  # fmt: skip
        t.add_section()
    limit, check = result["limit_ms"], result["check_ms"]
    t.add_row("limit, ms", "hash replicated bytes once + gather digests",
              f"{limit['best']:.1f}", f"{limit['median']:.1f}", "", "", "")  # fmt: skip
    for key, label in (("walk", "walk of DDP params + optimizer (caller's thread)"),
                       ("compare", "compare pass over the checksums (rank 0)")):  # fmt: skip
        row = check[key]
        t.add_row("check's own work, ms", label, f"{row['best']:.3f}", f"{row['median']:.3f}",
                  "", "", "")  # fmt: skip
    show(190, t)


def config() -> DiskConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=256, help="MiB of parameters")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", help="on a real disk (default: a temp dir under /tmp or the repo)")
    parser.add_argument("--smoke", action="store_true", help="8 MiB, 2 repeats: seconds")
    args = parser.parse_args()
    mib, repeats = (8, 2) if args.smoke else (args.mib_per_rank, args.repeats)
    if mib < 4 or args.ranks < 2 or repeats < 2:
        parser.error("need --mib-per-rank >= 4, --ranks >= 2, --repeats >= 2")
    workdir = disk_workdir(parser, args.dir, "unbroken-sdc-")
    return DiskConfig(args.ranks, mib, repeats, workdir, free_port())


def main() -> None:
    cfg = config()
    load = {"before": [round(x, 2) for x in os.getloadavg()]}
    try:
        run_ranks(worker, (cfg,), cfg.ranks)
        raw = read_back(cfg.dir)
    finally:
        shutil.rmtree(cfg.dir, ignore_errors=True)
    load["after"] = [round(x, 2) for x in os.getloadavg()]
    result = summarize(cfg, raw, load)
    table(result)
    print_result(result)
    if result["suspect"]:
        raise SystemExit("a healthy DDP job's save was marked suspect: the check is wrong")


if __name__ == "__main__":
    main()
