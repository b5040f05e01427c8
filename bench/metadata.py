# mypy: disallow-untyped-defs
"""Metadata at scale: the CPU time one rank spends on the plan and the manifest of a save,
and on the manifest of a restore, for a job of R ranks x T tensors each sharded over every
rank (FSDP), against DCP's for the same layout and against the bare JSON work, in one run.

    python bench/metadata.py                        # 8, 64 and 256 ranks x 1,000 tensors
    python bench/metadata.py --ranks 8 --tensors 100 --repeats 1     # smoke, seconds

No IO and no collectives: the work done between them, in this process (which has torch
loaded, as a training process has). The busiest rank, rank 0, in each case:

- save, unbroken: the gathered rows of every rank's blocks decoded and surveyed (the
  regions several ranks hold found), the write plan made, then the chunks the writers
  encoded decoded and joined into the manifest, as `unbroken.saving.pipeline` does on
  rank 0;
- save, DCP: its coordinator's work: every rank's local plan unpickled,
  ``DefaultSavePlanner.create_global_plan``, the storage info FileSystemWriter records
  per chunk, and the metadata pickled;
- restore, unbroken: the manifest parsed and validated (every rank); DCP: its
  ``.metadata`` unpickled (every rank);
- unbroken with the garbage collector running during all of this (`unbroken.job.gc_paused` pauses
  it), to show what the pause is worth;
- limit: json.loads of the same bytes (the rows; the manifest) and, for the save,
  json.dumps of the same manifest, with the collector paused: the part of the work no
  implementation of this format avoids.

Times are the best of the repeats (median beside), each after a full collection.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import pickle
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from common import new_table, print_result, show
from limits import check_limits
from unbroken.format import layout
from unbroken.format.layout import Chunk, Manifest, TensorEntry, joined
from unbroken.format.write_plan import Block, make_plan, survey
from unbroken.job import gc_paused

ROWS, COLS = 16, 4096  # one rank's shard of every tensor: 16 x 4096 bf16 (128 KiB)
SHARD = ROWS * COLS * 2


def _blocks(ranks: int, tensors: int, r: int) -> list[Block]:
    return [
        Block(key=f"layers.{t}.weight", dtype="BF16", shape=(ranks * ROWS, COLS),
              offsets=(r * ROWS, 0), local_shape=(ROWS, COLS), nbytes=SHARD,
              xxh3=f"{r * tensors + t:016x}")
        for t in range(tensors)
    ]  # fmt: skip


def rows_of(ranks: int, tensors: int) -> list[bytes]:
    """Each rank's row of blocks as `unbroken.job.comm.Comm.all_gather` carries it."""
    return [json.dumps([b.to_json() for b in _blocks(ranks, tensors, r)]).encode()
            for r in range(ranks)]  # fmt: skip


def written_of(ranks: int, tensors: int) -> list[bytes]:
    """Each rank's manifest chunks, as it encodes them once it has written its blocks
    (`unbroken.saving.pipeline._chunks`: a writer's work, not rank 0's)."""
    rows = []
    for r in range(ranks):
        name, at, chunks = f"r{r:05d}-000.safetensors", 4096, []
        for b in _blocks(ranks, tensors, r):
            chunks.append(Chunk(offsets=list(b.offsets), shape=list(b.local_shape), file=name,
                                start=at, end=at + SHARD, xxh3=b.xxh3).to_text())  # fmt: skip
            at += SHARD
        rows.append(json.dumps([chunks, {name: at}]).encode())
    return rows


def unbroken_save(wire: list[bytes], written: list[bytes], pause: Callable[[], Any]) -> bytes:
    """What `unbroken.saving.pipeline` does between its collectives, on rank 0."""
    with pause():
        rows = [json.loads(w) for w in wire]
    with pause():
        surveyed = survey(rows)
        surveyed.early  # noqa: B018 (the keys to hash first)
    with pause():
        plan = make_plan(surveyed, [{}] * len(rows))
    with pause():
        chunks: dict[str, list[str]] = {key: [] for key in plan.tensors}
        files = {}
        for rank, w in enumerate(written):  # as `Planner.manifest` joins them
            texts, sizes = json.loads(w)
            files.update(sizes)
            for key, text in zip(plan.writes[rank], texts, strict=True):
                chunks[key].append(text)
    world = len(wire)
    tensors = {key: TensorEntry(dtype=d, shape=s) for key, (d, s) in plan.tensors.items()}
    manifest = Manifest(step=1, world_size=world, created=0.0, tensors=tensors,
                        objects=[{}], rank_objects=[0] * world, files=files)  # fmt: skip
    return joined(manifest, chunks).data


def dcp_plans(ranks: int, tensors: int) -> list[bytes]:
    """Each rank's local save plan, pickled as gather_object carries it."""
    props = TensorProperties(dtype=torch.bfloat16)
    return [
        pickle.dumps(
            SavePlan(
                [
                    WriteItem(
                        index=MetadataIndex(f"layers.{t}.weight", torch.Size([r * ROWS, 0])),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(
                                offsets=torch.Size([r * ROWS, 0]), sizes=torch.Size([ROWS, COLS])
                            ),
                            properties=props,
                            size=torch.Size([ranks * ROWS, COLS]),
                        ),
                    )
                    for t in range(tensors)
                ],
                # the flattened state dict's paths, as DefaultSavePlanner records them
                planner_data={
                    f"layers.{t}.weight": ("layers", f"{t}.weight") for t in range(tensors)
                },
            )
        )
        for r in range(ranks)
    ]


def dcp_save(plans: list[bytes]) -> bytes:
    """DCP's coordinator: the global plan and the metadata FileSystemWriter writes."""
    local = [pickle.loads(p) for p in plans]
    global_plans, metadata = DefaultSavePlanner().create_global_plan(local)
    storage = {}
    for rank, plan in enumerate(global_plans):
        for i, item in enumerate(plan.items):
            storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", i * SHARD, SHARD)
    metadata.storage_data = storage
    return pickle.dumps(metadata)


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:  # the limit's JSON work: no collections at all
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def measure(ranks: int, tensors: int, repeats: int) -> dict[str, list[float]]:
    wire, plans = rows_of(ranks, tensors), dcp_plans(ranks, tensors)
    written = written_of(ranks, tensors)
    manifest = unbroken_save(wire, written, gc_paused.building)
    metadata = dcp_save(plans)
    body = json.loads(manifest)
    Manifest.from_json(manifest, "bench")  # it parses: the bench measures a valid manifest

    def limit_save() -> None:
        with collector_paused():
            [json.loads(w) for w in wire]
            json.dumps(body, separators=(",", ":"))

    def limit_restore() -> None:
        with collector_paused():
            json.loads(manifest)

    def unpaused(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            layout.building = contextlib.nullcontext  # type: ignore[assignment]
            try:
                return fn()
            finally:
                layout.building = gc_paused.building

        return run

    ops: dict[str, Callable[[], object]] = {
        "save limit": limit_save,
        "save unbroken": lambda: unbroken_save(wire, written, gc_paused.building),
        "save unbroken, collector running": unpaused(
            lambda: unbroken_save(wire, written, contextlib.nullcontext)
        ),
        "save DCP": lambda: dcp_save(plans),
        "restore limit": limit_restore,
        "restore unbroken": lambda: Manifest.from_json(manifest, "bench"),
        "restore unbroken, collector running": unpaused(
            lambda: Manifest.from_json(manifest, "bench")
        ),
        "restore DCP": lambda: pickle.loads(metadata),
    }
    out = {name: timed(fn, repeats) for name, fn in ops.items()}
    out["bytes"] = [len(manifest), len(metadata)]
    return out


def report(runs: dict[int, dict[str, list[float]]], tensors: int) -> dict[str, Any]:
    table = new_table(
        f"Metadata: R ranks x {tensors} tensors sharded over every rank, rank 0's CPU time",
        "seconds: best of repeats (median beside); 'of limit': the limit's time / the method's; "
        "'vs DCP': DCP's time / the method's; manifest / DCP metadata sizes in the op column",
        [(c, "right" if c in ("ranks", "blocks", "s", "median", "of limit", "vs DCP") else "left")
         for c in ("ranks", "blocks", "op", "method", "s", "median", "of limit", "vs DCP")],
    )  # fmt: skip
    result: dict[str, Any] = {"statistic": "best of repeats", "tensors": tensors, "runs": {}}
    fractions: dict[str, float] = {}
    for ranks, samples in runs.items():
        best = {k: min(v) for k, v in samples.items() if k != "bytes"}
        manifest, metadata = samples["bytes"]
        for op in ("save", "restore"):
            for method in ("limit", "unbroken", "unbroken, collector running", "DCP"):
                name = f"{op} {method}"
                # DCP's metadata is other bytes (a pickle): the JSON limit is not its limit
                of_limit: float | None = best[f"{op} limit"] / best[name]
                if method == "DCP":
                    of_limit = None
                if of_limit is not None and method != "limit":
                    fractions[f"{ranks} ranks {name}"] = of_limit
                where = f"{op} ({manifest / 2**20:.1f} / {metadata / 2**20:.1f} MiB)"
                table.add_row(
                    str(ranks), f"{ranks * tensors:,}", where if method == "limit" else "",
                    method, f"{best[name]:.3f}", f"{statistics.median(samples[name]):.3f}",
                    "" if of_limit is None else f"{of_limit:.0%}",
                    f"{best[f'{op} DCP'] / best[name]:.2f}x",
                )  # fmt: skip
        result["runs"][str(ranks)] = {"seconds": best, "samples": samples}
    show(150, table)
    result["fraction_of_limit"] = fractions
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = {r: measure(r, args.tensors, args.repeats) for r in args.ranks}
    result = report(runs, args.tensors)
    print_result(result)
    check_limits(result["fraction_of_limit"], "bench/metadata.py")


if __name__ == "__main__":
    main()
