"""Where a save's blocks are hashed: a region several ranks hold before the plan (which
dedupes it by checksum), a region one rank alone holds while it is written."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from ranks import run_ranks
from unbroken import Checkpointer
from unbroken.format.layout import Manifest, block_checksums, step_dir
from unbroken.format.shards import byte_view
from unbroken.format.write_plan import Block, survey
from unbroken.saving import checksums as describing
from unbroken.storage.local import LocalStorage

pytestmark = pytest.mark.timeout(120)


def _block(key: str, offsets: tuple[int, ...] = (0,)) -> Block:
    return Block(key=key, dtype="float32", shape=(8,), offsets=offsets, local_shape=(4,),
                 nbytes=16, xxh3="")  # fmt: skip


def test_only_regions_another_rank_holds_too_are_hashed_before_the_plan():
    rank0 = [_block("dp"), _block("row", (0,)), _block("mine")]
    rank1 = [_block("dp"), _block("row", (4,)), _block("rng")]
    assert _early([rank0, rank1]) == [["dp"], ["dp"]]
    # The same key and region on two ranks counts whatever the values: the plan tells
    # equal replicas from per-rank values by checksum, so both are needed first.
    assert _early([[_block("rng")], [_block("rng")]]) == [["rng"], ["rng"]]


def _early(blocks: list[list[Block]]) -> list[list[str]]:
    """The keys each rank hashes first, as rank 0 finds them in the rows it receives."""
    return survey(json.loads(json.dumps([[b.to_json() for b in rank] for rank in blocks]))).early


def test_a_block_only_this_rank_holds_is_hashed_while_it_is_written(tmp_path, monkeypatch):
    """The hash of the only block waits until its file's upload has begun: a save that
    hashed everything before writing would time out here."""
    writing = threading.Event()
    hashed_while_writing: list[bool] = []
    write, checksums = LocalStorage.write, describing.block_checksums

    def write_and_say(self, path, parts):
        if path.endswith(".safetensors"):
            writing.set()
        return write(self, path, parts)

    def hash_once_writing(data, *args):
        hashed_while_writing.append(writing.wait(timeout=10))
        return checksums(data, *args)

    monkeypatch.setattr(LocalStorage, "write", write_and_say)
    monkeypatch.setattr(describing, "block_checksums", hash_once_writing)
    weights = torch.randn(1 << 16)
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, {"w": weights})
    assert hashed_while_writing == [True]
    where = tmp_path / step_dir(1) / "manifest.json"
    [entry] = Manifest.from_json(where.read_bytes(), str(where)).tensors.values()
    [chunk] = entry.chunks
    assert chunk.xxh3 == block_checksums(byte_view(weights)).xxh3
    restored = {"w": torch.zeros_like(weights)}
    assert Checkpointer(str(tmp_path)).restore(restored) == 1  # verifies the checksum
    assert torch.equal(restored["w"], weights)


def _job(rank: int, world: int, path: str) -> list[str]:
    """A replicated tensor and a per-rank shard; each hash records its size and whether
    any shard file was being written by then."""
    from unbroken.saving import checksums as d

    seen: list[str] = []
    files: list[str] = []
    write, checksums = LocalStorage.write, d.block_checksums

    def note_write(self, path, parts):
        files.append(path)
        return write(self, path, parts)

    def note_hash(data, *args):
        when = "after" if any(f.endswith(".safetensors") for f in files) else "before"
        seen.append(f"{len(data)}:{when}")
        return checksums(data, *args)

    LocalStorage.write, d.block_checksums = note_write, note_hash  # type: ignore[method-assign]
    torch.manual_seed(0)
    replicated = torch.randn(1000)
    shard = torch.full((300,), float(rank))
    ckpt = Checkpointer(path)
    ckpt.save(1, {"dp": replicated, "shard": {f"rank{rank}": shard}})
    dp, mine = torch.zeros(1000), torch.zeros(300)
    assert ckpt.restore({"dp": dp, "shard": {f"rank{rank}": mine}}) == 1
    assert torch.equal(dp, replicated) and torch.equal(mine, shard)
    ckpt.close()
    return seen


def test_a_replicated_block_is_hashed_before_any_write_and_each_block_once(tmp_path):
    for seen in run_ranks(_job, str(tmp_path / "ckpt")):
        # The replica before the plan (so before any write), the shard once, with its
        # upload (whether its write or its hash starts first is up to the threads).
        assert seen[0] == "4000:before" and len(seen) == 2 and seen[1].startswith("1200:"), seen
