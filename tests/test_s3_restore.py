"""Restores from S3 keep what they read in the client's response buffers (from files: their
mapped pages) until every rank has read and checked its part, then place it: a failure
anywhere, on any rank, leaves the live state as it was, and no backup copy of the state is
taken (`unbroken.restoring.reading`)."""

import os

import pytest
import torch

import unbroken
from conftest import s3_client
from ranks import run_ranks
from unbroken import Checkpointer, CorruptCheckpointError
from unbroken.format.layout import step_dir
from unbroken.storage.local import LocalStorage
from unbroken.storage.s3 import S3Options, S3Storage


def _state(rank=0):
    g = torch.Generator().manual_seed(rank)
    state = {f"rank{rank}.big": torch.randn(3 << 20, generator=g)}  # 12 MiB: several GETs
    state |= {f"rank{rank}.t{i:02d}": torch.randn(1000, generator=g) for i in range(30)}
    return state


def _zeros(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _damage(ckpt, uri, options, key):
    """Flip a byte of ``key``'s block in step 1 (``ckpt`` is a `Checkpointer` of ``uri``)."""
    chunk = ckpt.manifest(1).tensors[key].chunks[0]
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    name = f"{prefix}/{step_dir(1)}/{chunk.file}"
    client = s3_client(options["endpoint"])
    data = bytearray(client.get_object(Bucket=bucket, Key=name)["Body"].read())
    data[chunk.start] ^= 0xFF
    client.put_object(Bucket=bucket, Key=name, Body=bytes(data))


def test_a_damaged_block_from_s3_or_a_file_changes_nothing_and_costs_no_backup(
    bucket, tmp_path, backups
):
    uri, options = bucket
    state = _state()
    saver = Checkpointer(uri, storage_options=options)
    saver.save(1, state)

    fresh = _zeros(state)
    assert Checkpointer(uri, storage_options=options).restore(fresh) == 1
    assert all(torch.equal(fresh[k], state[k]) for k in state)

    _damage(saver, uri, options, "rank0.t29")  # the last block read: the others are in by then
    before = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    live = {k: v.clone() for k, v in before.items()}
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'rank0\.t29'.*fails its checksum"):
        Checkpointer(uri, storage_options=options).restore(live, step=1)
    assert all(torch.equal(live[k], before[k]) for k in state)
    assert backups.nbytes == 0  # the responses were the copy

    local = Checkpointer(tmp_path)  # a file's pages are held the same way
    local.save(1, state)
    chunk = local.manifest(1).tensors["rank0.t29"].chunks[0]
    with open(tmp_path / step_dir(1) / chunk.file, "r+b") as f:
        f.seek(chunk.start)
        byte = f.read(1)[0]
        f.seek(chunk.start)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'rank0\.t29'.*fails its checksum"):
        Checkpointer(tmp_path).restore(live, step=1)
    assert all(torch.equal(live[k], before[k]) for k in state)
    assert backups.nbytes == 0


def _restore_both(rank, world, uri, options):
    state = _state(rank)
    saver = Checkpointer(uri, storage_options=options)
    saver.save(1, state)
    if rank == 0:
        _damage(saver, uri, options, "rank1.t29")
    torch.distributed.barrier()
    live = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    try:
        Checkpointer(uri, storage_options=options).restore(live, step=1)
    except unbroken.CheckpointError as e:
        error = str(e)
    return error, all(bool((t == 7.0).all()) for t in live.values())


def test_a_rank_whose_read_fails_leaves_every_ranks_state_as_it_was(bucket):
    uri, options = bucket
    (error0, same0), (error1, same1) = run_ranks(_restore_both, uri, options, timeout=120)
    assert "rank1.t29" in error1 and "fails its checksum" in error1
    assert "rank 1" in error0  # rank 0 read all of its own, and hears why the step failed
    assert same0 and same1  # rank 0's bytes were never placed


def _manifest_reads(rank, world, uri, options):
    state = _state(rank)
    Checkpointer(uri, storage_options=options).save(1, state)
    reader = Checkpointer(uri, storage_options=options)
    storage, read, names = reader.storage, reader.storage.read, []

    def counted(name):
        names.append(name)
        return read(name)

    storage.read = counted  # type: ignore[method-assign]
    live = _zeros(state)
    step = reader.restore(live)
    same = all(torch.equal(live[k], state[k]) for k in state)
    return step, same, sum(n.endswith("manifest.json") for n in names)


def test_one_rank_reads_the_manifest_for_the_job(bucket):
    """Rank 0 fetches it while choosing the step and hands it to the others with the
    choice: one request for the job, not one per rank."""
    uri, options = bucket
    results = run_ranks(_manifest_reads, uri, options, timeout=120)
    assert results == [(1, True, 1), (1, True, 0)]


def test_read_range_and_read_scatter_take_one_request(bucket):
    uri, options = bucket
    storage = S3Storage(uri, S3Options(**options))
    data = bytes(range(256)) * 64
    storage.write("f", [data])
    before = storage.requests["GET"]
    assert bytes(storage.read_range("f", 100, 50)) == data[100:150]
    parts = [(10, memoryview(bytearray(5))), (40, memoryview(bytearray(20)))]  # a gap
    storage.read_scatter("f", parts)
    assert [bytes(out) for _, out in parts] == [data[10:15], data[40:60]]
    assert storage.requests["GET"] - before == 2
    with pytest.raises(EOFError, match="ends before byte"):
        storage.read_range("f", len(data) - 10, 20)


def test_a_file_range_is_its_pages_mapped(tmp_path):
    storage = LocalStorage(str(tmp_path))
    data = bytes(range(256)) * 64  # 16 KiB: ranges that start off a page boundary too
    storage.write("f", [data])
    for offset, length in [(0, len(data)), (5000, 7000), (100, 0)]:
        assert bytes(storage.read_range("f", offset, length)) == data[offset : offset + length]
    view = storage.read_range("f", 4096, 10)
    with pytest.raises(TypeError):
        view[0] = 1  # read-only: a restore cannot write through to the checkpoint
    with pytest.raises(EOFError, match="ends before byte"):
        storage.read_range("f", len(data) - 10, 20)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_a_restore_keeps_none_of_what_it_read(tmp_path):
    state = _state()
    Checkpointer(tmp_path).save(1, state)
    Checkpointer(tmp_path).restore(_zeros(state))
    with open("/proc/self/maps") as f:  # the IO workers once kept their last call's buffers
        assert [line for line in f if str(tmp_path) in line] == []
