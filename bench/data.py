"""Time from process start to first batch, for a token file of --size (default 1 GiB):

    python bench/data.py                   # 1 GiB of uint16 tokens, in a folder on disk
    python bench/data.py --size 64MiB      # a smoke run

Four cases, each a new Python process (as a restarted rank is), all reading batches of
--seq-len tokens through the same ResumableSampler and DataLoader (--workers workers):

- fresh start: `unbroken.data.TokenDataset` memory-maps the file, whose pages are not in
  the page cache (evicted first: a node that never read it), and takes the first batch
  of the epoch;
- restart, re-attach: the same, with the file in the page cache (a process restarted on
  the node where the previous one read it), at a saved position in mid-epoch;
- restart, naive: a loader that reads the whole file into memory (``numpy.fromfile``),
  from the page cache, then takes the same batch;
- fresh start, naive: the same with the file evicted first.

"start -> first batch" runs from just before the parent starts the process to the first
batch in the child's hands; "data" leaves out the interpreter start and the imports
(Python, torch), which are the same in every case. Target: re-attaching takes at most
10 % of the naive restart's data time. Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from common import disk_workdir, evict, new_table, print_result, show
from unbroken.data import ResumableLoader, ResumableSampler, TokenDataset, TokenWriter

TARGET = 0.10  # re-attach / naive restart, data time
CASES = {  # name: (loader, page cache warm, resume in mid-epoch)
    "fresh start": ("mapped", False, False),
    "restart, re-attach": ("mapped", True, True),
    "restart, naive": ("naive", True, True),
    "fresh start, naive": ("naive", False, False),
}
WRITE_CHUNK = 1 << 26  # tokens per write while making the file


class InMemoryTokens(Dataset[torch.Tensor]):
    """The naive loader: the whole file read into memory, then the same samples as
    TokenDataset (``seq_len + 1`` tokens every ``seq_len``)."""

    def __init__(self, path: str, seq_len: int) -> None:
        meta = json.loads(Path(f"{path}.json").read_text())
        self.tokens = np.fromfile(path, dtype=meta["dtype"])
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


def child(args: argparse.Namespace) -> None:
    """One case in this process: print when the imports ended and the first batch came."""
    imported = time.time()
    loader_kind, _, resume = CASES[args.child]
    if loader_kind == "mapped":
        dataset: Dataset[torch.Tensor] = TokenDataset(args.file, args.seq_len)
    else:
        dataset = InMemoryTokens(args.file, args.seq_len)
    sampler = ResumableSampler(len(dataset), args.batch, seed=0)  # type: ignore[arg-type]
    loader = ResumableLoader(DataLoader(dataset, batch_sampler=sampler, num_workers=args.workers))
    if resume:  # the position a checkpoint restores: mid-epoch
        loader.load_state_dict({**sampler.state_dict(), "position": len(sampler) // 2 * args.batch})
    batch = next(iter(loader))
    first = time.time()
    assert batch.shape == (args.batch, args.seq_len + 1)
    print(json.dumps({"imported": imported, "first": first}), flush=True)


def make_file(path: Path, size: int) -> None:
    """``size`` bytes of random uint16 tokens (fsynced by TokenWriter, hence evictable)."""
    if path.exists() and Path(f"{path}.json").exists() and path.stat().st_size == size:
        return
    rng = np.random.default_rng(0)
    with TokenWriter(path, "uint16") as writer:
        for start in range(0, size // 2, WRITE_CHUNK):
            count = min(WRITE_CHUNK, size // 2 - start)
            writer.append(rng.integers(0, 50_000, count, dtype=np.uint16))


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def run_case(args: argparse.Namespace, name: str, path: Path) -> dict[str, float]:
    _, cached, _ = CASES[name]
    if cached:
        warm(path)
    else:
        evict(str(path.parent))
    cmd = [sys.executable, __file__, "--child", name, "--file", str(path)]
    cmd += [f"--seq-len={args.seq_len}", f"--batch={args.batch}", f"--workers={args.workers}"]
    spawned = time.time()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    times = json.loads(out.strip().splitlines()[-1])
    return {"total_s": times["first"] - spawned, "data_s": times["first"] - times["imported"]}


def measure(args: argparse.Namespace, path: Path) -> dict[str, dict[str, float]]:
    """Every case --repeats times, interleaved; the median of each figure."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name in CASES:
            runs[name].append(run_case(args, name, path))
    return {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }


def report(args: argparse.Namespace, size: int, medians: dict[str, dict[str, float]]) -> None:
    naive = medians["restart, naive"]
    table = new_table(
        f"Process start to first batch, {size / (1 << 30):.2f} GiB token file",
        f"median of {args.repeats}; seq_len {args.seq_len}, batch {args.batch}, "
        f"{args.workers} DataLoader workers; 'data' leaves out interpreter start and imports",
        [("case", "left"), ("start -> first batch", "right"), ("data", "right"),
         ("data vs naive restart", "right")],
    )  # fmt: skip
    for name, m in medians.items():
        ratio = m["data_s"] / naive["data_s"]
        table.add_row(name, f"{m['total_s']:.3f} s", f"{m['data_s']:.3f} s", f"{ratio:.1%}")
    show(100, table)
    reattach = medians["restart, re-attach"]
    ratio = reattach["data_s"] / naive["data_s"]
    print_result(
        {
            "bytes": size,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "workers": args.workers,
            "repeats": args.repeats,
            "cases": medians,
            "reattach_over_naive_data": round(ratio, 4),
            "reattach_over_naive_total": round(reattach["total_s"] / naive["total_s"], 4),
            "target": TARGET,
            "target_met": ratio <= TARGET,
        }
    )


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    for unit, scale in units.items():
        if text.lower().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="token file size, e.g. 1GiB, 64MiB")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="samples per batch")
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader workers (their start is the same in every case)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="on a real disk (default: a temp dir under /tmp or the repo)")
    parser.add_argument("--keep", action="store_true", help="keep the token file for next time")
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    size = parse_size(args.size) // 2 * 2
    where = Path(disk_workdir(parser, args.dir, "unbroken-bench-data-"))
    path = where / "tokens.bin"
    try:
        print(f"writing {size / (1 << 20):.0f} MiB of tokens to {path} ...", flush=True)
        make_file(path, size)
        report(args, size, measure(args, path))
    finally:
        if not args.keep:
            for p in (path, Path(f"{path}.json")):
                p.unlink(missing_ok=True)
            if not any(where.iterdir()):
                where.rmdir()


if __name__ == "__main__":
    main()
