"""The contract every restore source passes, as every storage backend passes
tests/test_storage.py: storage, this node's shared memory, a peer's replica (2 real
processes on gloo). A whole step reads back exactly; a missing step is a CheckpointError
naming it; a damaged block a CorruptCheckpointError naming the tensor; a source that
disappears mid-read a clear CheckpointError, quickly, never a hang."""

from __future__ import annotations

import os
import shutil
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from ranks import run_ranks
from unbroken import Checkpointer
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format import shards
from unbroken.format.directory import Directory
from unbroken.format.layout import Manifest, step_dir
from unbroken.memory.snapshots import blocks_of, copy, seal
from unbroken.memory.tier import MemoryTier
from unbroken.restoring.sources import Fill, MemorySource, ReplicaSource, Source, StorageSource
from unbroken.storage import open_storage

pytestmark = pytest.mark.timeout(120)

STEP = 7
TIMEOUT_S = 5.0  # the replica's group: a dead provider must not cost more than this


def _state() -> dict[str, torch.Tensor]:
    # Two blocks over 1 MiB each: read (or sent) one request each, so a source can
    # disappear between them.
    return {
        "a": torch.arange(300_000, dtype=torch.float32),
        "b": torch.arange(300_000, dtype=torch.int32) * 3,
    }


def _fills(manifest: Manifest, rank: int) -> list[Fill]:
    """A fresh destination for every tensor of ``manifest`` this rank restores."""
    fills = []
    for key, entry in manifest.tensors.items():
        chunks = [c for c in entry.chunks if c.ranks is None or rank in c.ranks]
        region = torch.empty(entry.shape, dtype=entry.torch_dtype)
        fills.append(Fill(key, entry, chunks, region, [0] * len(entry.shape)))
    return fills


def _load(source: Source, rank: int = 0) -> dict[str, torch.Tensor]:
    """What a restore does with a source on one rank: open, check, read."""
    manifest = source.open()
    fills = _fills(manifest, rank)
    source.check(manifest, {c.file for f in fills for c in f.chunks})
    place = source.read(manifest, fills, threads=1)
    if place is not None:  # what it held, checked: the restore's to place
        place()
    return {f.key: f.region for f in fills}


def _outcome(load: Any) -> tuple[str, str]:
    """``("ok", "")`` if ``load()`` gives back the saved state, else the error's type and
    message. Anything but a CheckpointError fails the test."""
    try:
        got = load()
    except CheckpointError as e:
        return type(e).__name__, str(e)
    expected = _state()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    return "ok", ""


def _flip(data: torch.Tensor, at: int) -> None:
    data[at] = 255 - int(data[at])


class Vanishing:
    """A storage whose ``folder`` is deleted right after the first read from it: the
    files disappear between two reads of one restore."""

    def __init__(self, inner: Any, folder: str) -> None:
        self.inner, self.folder, self.reads = inner, folder, 0

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(path, offset, out)
        self._vanish()

    def read_range(self, path: str, offset: int, length: int) -> memoryview:
        view: memoryview = self.inner.read_range(path, offset, length)
        self._vanish()
        return view

    def _vanish(self) -> None:
        self.reads += 1
        if self.reads == 1:
            self.inner.delete(self.folder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# -- the three sources, each set up for a case ------------------------------------------


def _storage(tmp_path: Any, case: str) -> tuple[str, str]:
    path = str(tmp_path / "ckpt")
    Checkpointer(path).save(STEP, _state())
    directory = Directory(open_storage(path), path)
    source = StorageSource(directory, STEP + 1 if case == "missing" else STEP)
    if case == "damaged":
        chunk = directory.manifest(STEP).tensors["b"].chunks[0]
        file = tmp_path / "ckpt" / step_dir(STEP) / chunk.file
        raw = bytearray(file.read_bytes())
        raw[chunk.start + 5] ^= 0xFF
        file.write_bytes(raw)
    if case == "vanishes":
        source.storage = Vanishing(source.storage, step_dir(STEP))
    return _outcome(lambda: _load(source))


def _memory(tmp_path: Any, case: str) -> tuple[str, str]:
    tier = MemoryTier(str(tmp_path / "shm"), "job", rank=0, world_size=1)
    _snapshot(tier)
    source = MemorySource(tier.own, STEP + 1 if case == "missing" else STEP)
    if case == "damaged":
        text, data = tier.own.raw(STEP)
        _flip(data, Manifest.from_json(text.encode(), "slot").tensors["b"].chunks[0].start)
    if case == "vanishes":  # deleted once checked: the bytes read are the pages it mapped
        opened = source.open

        def open_then_vanish() -> Manifest:
            manifest = opened()
            shutil.rmtree(tier.own.dir)
            return manifest

        source.open = open_then_vanish  # type: ignore[method-assign]
    return _outcome(lambda: _load(source))


def _snapshot(tier: MemoryTier) -> None:
    blocks, tree = blocks_of(_state())
    copied = copy(tier, STEP, blocks)
    seal(tier, copied, tree)
    tier.own.release(copied.slot)


def _replica_job(rank: int, world: int, root: str, case: str) -> tuple[str, str, float] | None:
    """Rank 1's own copy is gone; rank 0 holds its replica and provides it."""
    import torch.distributed as dist

    from unbroken.job.comm import Comm
    from unbroken.memory import replicas

    comm = Comm(None, timedelta(seconds=TIMEOUT_S))
    memory = MemoryTier(os.path.join(root, f"node-{rank}"), "job", rank, world)
    _snapshot(memory)
    replicas.replicate(comm, memory, STEP, [1 - rank], [1 - rank])
    step, plan = STEP + 1 if case == "missing" else STEP, {1: 0}
    if case == "damaged" and rank == 0:
        text, data = memory.replica(1).raw(STEP)
        _flip(data, Manifest.from_json(text.encode(), "slot").tensors["b"].chunks[0].start)
    started = time.monotonic()

    def load() -> dict[str, torch.Tensor]:
        text = replicas.manifests(comm, memory, step, plan)
        if rank == 0:
            if case == "vanishes":  # the first block goes out, then the provider dies
                offered, data = memory.replica(1).raw(STEP)
                _, first = replicas.blocks(Manifest.from_json(offered.encode(), "replica"))[0]
                dist.send(data[first.start : first.end], group=comm.group, group_dst=1)
                os._exit(0)
            replicas.send(comm, memory, step, plan).wait()
            return _state()
        assert text is not None
        return _load(ReplicaSource(comm, 0, step, text), rank)

    kind, message = _outcome(load)
    return (kind, message, time.monotonic() - started) if rank == 1 else None


def _replica(tmp_path: Any, case: str) -> tuple[str, str]:
    exits = [0] if case == "vanishes" else []
    result = run_ranks(_replica_job, str(tmp_path), case, timeout=60, exits=exits)[1]
    kind, message, seconds = result
    assert seconds < TIMEOUT_S + 10, f"the error took {seconds:.1f} s"
    return kind, message


SOURCES = {"storage": _storage, "memory": _memory, "replica": _replica}


@pytest.fixture(params=sorted(SOURCES))
def attempt(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """``attempt(case)``: set up this source for ``case``, restore from it, and return
    ``(error type or "ok", message)``."""
    return lambda case: SOURCES[request.param](tmp_path, case)


# -- the contract ---------------------------------------------------------------------


def test_a_whole_step_reads_back_exactly(attempt):
    assert attempt("whole") == ("ok", "")


def test_a_missing_step_is_a_clear_error_naming_it(attempt):
    kind, message = attempt("missing")
    assert kind == "CheckpointError", message
    assert f"step {STEP + 1}" in message


def test_a_damaged_block_is_caught_naming_the_tensor(attempt):
    kind, message = attempt("damaged")
    assert kind == CorruptCheckpointError.__name__, message
    assert "tensor 'b'" in message and "fails its checksum" in message


def test_a_source_that_disappears_mid_read_is_a_clear_error(attempt, request):
    kind, message = attempt("vanishes")
    if request.node.callspec.params["attempt"] == "memory":
        # A snapshot is read from the pages it was checked in, mapped on opening: they
        # outlive its files, so the restore is whole (checked bitwise by `_outcome`).
        assert (kind, message) == ("ok", "")
        return
    assert kind == "CheckpointError", message
    assert "disappeared" in message


class _SlowSizes:
    """A storage whose size requests take a round trip of 50 ms, counting how many are
    in flight at once."""

    requests_in_flight = 8

    def __init__(self, inner: Any) -> None:
        self.inner, self.now, self.most = inner, 0, 0
        self.lock = threading.Lock()

    def size(self, path: str) -> int:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.05)
        with self.lock:
            self.now -= 1
        return int(self.inner.size(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_restore_checks_its_files_sizes_at_once(tmp_path, monkeypatch):
    """A rank reading six files waits for one round trip of size requests, not six."""
    monkeypatch.setattr(shards, "FILE_BYTES", 1 << 10)  # a file per tensor
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(6)}
    Checkpointer(str(tmp_path)).save(STEP, state)
    ckpt = Checkpointer(str(tmp_path))
    assert len(ckpt.manifest(STEP).files) == 6
    ckpt.storage = slow = _SlowSizes(ckpt.storage)
    back = {key: torch.zeros(1024) for key in state}
    assert ckpt.restore(back) == STEP
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert slow.most == 6
