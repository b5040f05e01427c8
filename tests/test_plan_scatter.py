"""A save's metadata and a restore's checks at scale (issue 33): rank 0 alone decodes
every rank's blocks and plans the save, the others receive only their part; a restore's
ranks each check one part of the manifest and exchange their verdicts, so a damaged
entry in any rank's part fails the restore on every rank with the clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ranks import run_ranks
from unbroken.errors import CorruptCheckpointError
from unbroken.format.layout import MANIFEST, parse, step_dir
from unbroken.format.validate import share

pytestmark = pytest.mark.timeout(180)
KEYS = [f"t{i}" for i in range(6)]  # replicated: one chunk each, two per rank's part


def _save_job(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch

    import unbroken
    from unbroken.format import write_plan
    from unbroken.job.comm import Comm
    from unbroken.saving import planning

    decoded = [0]
    real_survey = write_plan.survey

    def counting(rows_by_rank: list[list[Any]]) -> Any:
        decoded[0] += sum(len(rows) for rows in rows_by_rank)
        return real_survey(rows_by_rank)

    write_plan.survey = counting
    planning.survey = counting
    received: list[Any] = []
    real_scatter = Comm.scatter

    def scatter(self: Comm, parts: Any) -> Any:
        received.append(part := real_scatter(self, parts))
        return part

    Comm.scatter = scatter  # type: ignore[method-assign]
    state = {f"mine{rank}.{i}": torch.full((64,), float(rank * 10 + i)) for i in range(4)}
    state["dp"] = torch.arange(32.0)  # the same on every rank: written once
    ckpt = unbroken.Checkpointer(path)
    ckpt.save(1, state)
    saved = {k: v.clone() for k, v in state.items()}
    for v in state.values():
        v.zero_()
    ckpt.restore(state)
    ckpt.close()
    back = all(torch.equal(state[k], saved[k]) for k in state)
    return {"decoded": decoded[0], "received": json.dumps(received), "restored": back}


def test_only_rank_0_decodes_every_rank_s_blocks_the_others_get_their_own_part(tmp_path):
    world = 3
    rows = run_ranks(_save_job, str(tmp_path), world=world)
    assert all(r["restored"] for r in rows)
    assert rows[0]["decoded"] == world * 5  # every rank's 4 own blocks and its "dp"
    for rank, row in enumerate(rows[1:], start=1):
        assert row["decoded"] == 0, f"rank {rank} decoded blocks: {row['decoded']}"
        others = [f"mine{q}." for q in range(world) if q != rank]
        assert not any(o in row["received"] for o in others), (rank, row["received"])
    manifest = json.loads((tmp_path / step_dir(1) / MANIFEST).read_bytes())
    assert len(manifest["tensors"]["dp"]["chunks"]) == 1  # planned once, written once
    writers = {c["file"][:6] for k, e in manifest["tensors"].items() for c in e["chunks"]}
    assert writers == {f"r{q:05d}" for q in range(world)}  # each rank wrote its part


def _damaged_part_job(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import unbroken
    from unbroken.format import validate

    checked = [0]
    real_tensor = validate._tensor

    def counting(*args: Any) -> None:
        checked[0] += 1
        real_tensor(*args)

    validate._tensor = counting  # type: ignore[assignment]
    state = {k: torch.full((8,), float(i)) for i, k in enumerate(KEYS)}
    ckpt = unbroken.Checkpointer(path)
    ckpt.save(1, state)
    ckpt.save(2, state)
    if rank == 0:  # step 2's manifest damaged in the part the last rank checks
        file = Path(path, step_dir(2), MANIFEST)
        raw = json.loads(file.read_bytes())
        damaged = share(raw["tensors"], (world - 1, world))[0]
        raw["tensors"][damaged]["dtype"] = "F99"
        file.write_text(json.dumps(raw))
    dist.barrier()
    out: dict[str, Any] = {}
    checked[0] = 0
    try:
        ckpt.restore(state, step=2)
    except unbroken.CheckpointError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["checked"] = checked[0]
    out["fell_back_to"] = ckpt.restore(state)  # the newest that verifies
    assert ckpt.last_restore is not None
    out["damaged"] = [o.step for o in ckpt.last_restore.damaged]
    ckpt.close()
    return out


def test_a_damaged_entry_in_one_rank_s_part_fails_the_restore_on_every_rank(tmp_path):
    world = 3
    rows = run_ranks(_damaged_part_job, str(tmp_path), world=world)
    errors = {r["error"] for r in rows}
    assert len(errors) == 1, errors  # every rank: the same error
    [error] = errors
    where = f"{tmp_path}/{step_dir(2)}/{MANIFEST}: tensor 't4': unknown dtype 'F99'"
    assert error.startswith(f"CorruptCheckpointError: {where}"), error
    # Each rank checked its own two tensors, not all six (the last stops at its first).
    assert [r["checked"] for r in rows] == [2, 2, 1]
    assert all(r["fell_back_to"] == 1 and r["damaged"] == [2] for r in rows), rows
    # Only the last rank's part holds the damage: the others' verdicts were exchanged.
    data = (tmp_path / step_dir(2) / MANIFEST).read_bytes()
    for k in range(world - 1):
        parse(data, "m", (k, world))
    with pytest.raises(CorruptCheckpointError, match="tensor 't4': unknown dtype"):
        parse(data, "m", (world - 1, world))


def test_the_parts_together_check_what_the_whole_checks():
    """Every tensor falls in exactly one part, and the parts are even in chunks."""
    tensors: dict[str, Any] = {f"k{i}": {"chunks": [{}] * (1 + i % 5)} for i in range(40)}
    tensors["bad"] = "not an entry"  # counts one chunk, checked by one part like any
    for parts in (1, 2, 3, 7, 64):
        shares = [share(tensors, (k, parts)) for k in range(parts)]
        assert sorted(k for s in shares for k in s) == sorted(tensors)
        sizes = [sum(1 if k == "bad" else len(tensors[k]["chunks"]) for k in s) for s in shares]
        assert max(sizes) <= sum(sizes) / parts + 5, (parts, sizes)


def test_rank_0_joins_the_chunks_its_writers_encoded_in_each_tensor_s_order():
    """Out of rank order (rank 0 holds the second rows) and a region whose value differs
    between ranks: the manifest is what the writers encoded, each tensor's chunks sorted
    by region then ranks, and a tagged chunk's writer was told the ranks to name."""
    from unbroken.format.layout import Chunk, Manifest
    from unbroken.format.write_plan import Block
    from unbroken.saving.planning import Planner

    def block(key: str, offset: int, xxh3: str = "") -> list[Any]:
        return Block(key=key, dtype="F32", shape=(8,), offsets=(offset,), local_shape=(4,),
                     nbytes=16, xxh3=xxh3).to_json()  # fmt: skip

    rows = [[1, False, [block("s", 4), block("rng", 0)], []],
            [1, False, [block("s", 0), block("rng", 0)], []]]  # fmt: skip
    planner = Planner(step=1, replicated=None, storage=None)
    early = planner.layout(json.loads(json.dumps(rows)))
    assert early == [[None, False, ["rng"]], [None, False, ["rng"]]]
    sums = [{"rng": {"xxh3": "a0"}}, {"rng": {"xxh3": "a1"}}]  # the values differ
    parts = planner.writes(sums)
    assert [sorted(p[0]) for p in parts] == [["rng", "s"], ["rng", "s"]]
    assert [p[1] for p in parts] == [{"rng": [0]}, {"rng": [1]}]
    written = []
    for rank, (keys, tags) in enumerate(parts):
        name = f"r{rank:05d}-000.safetensors"
        offsets = {"s": 4 - 4 * rank, "rng": 0}
        texts = [Chunk(offsets=[offsets[k]], shape=[4], file=name, start=16 * i, end=16 * i + 16,
                       xxh3=sums[rank].get(k, {}).get("xxh3", "5"), ranks=tags.get(k)).to_text()
                 for i, k in enumerate(keys)]  # fmt: skip
        written.append([texts, {name: 16 * len(keys)}, {"step": 1}])
    assert planner.wrote(json.loads(json.dumps(written))) == [None, None]
    m = Manifest.from_json(planner.manifest(2, 0.0).to_json(), "m")
    assert [(c.offsets, c.file[:6]) for c in m.tensors["s"].chunks] == [
        ([0], "r00001"),
        ([4], "r00000"),
    ]
    assert [(c.ranks, c.xxh3) for c in m.tensors["rng"].chunks] == [([0], "a0"), ([1], "a1")]
    assert m.rank_objects == [0, 0] and m.objects == [{"step": 1}]
