"""unbroken.data: token files, TokenDataset, ResumableSampler/ResumableLoader, tokenise.

The resumption property is checked against an uninterrupted run, over the step, the world
size (and a change of it) and the number of DataLoader workers, with real worker
processes prefetching ahead of the loop.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import unbroken
from ranks import run_ranks
from unbroken.cli.main import main as cli
from unbroken.data import (
    ByteTokenizer,
    DataFileError,
    ResumableLoader,
    ResumableSampler,
    TokenDataset,
    TokenWriter,
    tokenise,
)
from unbroken.data.files import sidecar
from unbroken.demo.model import load_corpus
from unbroken.errors import CheckpointError

SEQ = 4


def _arange_file(path: Path, samples: int) -> Path:
    """A token file whose sample i starts with token i * SEQ: batches name their indices."""
    with TokenWriter(path, "uint32") as w:
        w.append(np.arange(samples * SEQ + 1))
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    return TokenDataset(_arange_file(tmp_path_factory.mktemp("d") / "a.bin", 53), SEQ)


def _indices(batch: torch.Tensor) -> list[int]:
    return (batch[:, 0] // SEQ).tolist()


def _loader(ds: TokenDataset, rank: int, world: int, workers: int, batch: int) -> ResumableLoader:
    sampler = ResumableSampler(ds, batch, seed=5, rank=rank, world_size=world)
    return ResumableLoader(DataLoader(ds, batch_sampler=sampler, num_workers=workers))


def _steps(loaders: list[ResumableLoader], steps: int) -> list[list[list[int]]]:
    """``steps`` global batches (each: every rank's indices, in rank order), across epochs,
    leaving every loader paused mid-iteration (its workers still prefetching)."""
    its = [_forever(loader) for loader in loaders]
    out = [[_indices(next(it)) for it in its] for _ in range(steps)]
    return out


def _forever(loader: ResumableLoader) -> Iterator[torch.Tensor]:
    while True:
        yield from loader


@settings(max_examples=8, deadline=None, database=None)
@given(
    step=st.integers(0, 40),
    world=st.integers(1, 3),
    workers=st.integers(0, 2),
    batch=st.integers(1, 3),
)
def test_resuming_at_any_step_yields_the_uninterrupted_batches(
    dataset: TokenDataset, step: int, world: int, workers: int, batch: int
) -> None:
    reference = _steps([_loader(dataset, r, world, 0, batch) for r in range(world)], step + 12)
    first = [_loader(dataset, r, world, workers, batch) for r in range(world)]
    assert _steps(first, step) == reference[:step]
    saved = [loader.state_dict() for loader in first]
    assert all(s == saved[0] for s in saved)  # global: the same on every rank
    resumed = [_loader(dataset, r, world, 2 - workers, batch) for r in range(world)]
    for loader in resumed:
        loader.load_state_dict(json.loads(json.dumps(saved[0])))  # as a checkpoint holds it
    assert _steps(resumed, 12) == reference[step:]


@settings(max_examples=8, deadline=None, database=None)
@given(
    step=st.integers(0, 25),
    world=st.integers(1, 4),
    new_world=st.integers(1, 4),
    workers=st.integers(0, 2),
)
def test_another_world_size_continues_the_epoch_without_repeat_or_skip(
    dataset: TokenDataset, step: int, world: int, new_world: int, workers: int
) -> None:
    batch = 2
    first = [_loader(dataset, r, world, workers, batch) for r in range(world)]
    before = _steps(first, step)
    state = first[0].state_dict()
    epoch = state["epoch"]
    # What the epoch of the checkpoint handed out before it: its last `done` steps.
    per_step = batch * world
    done = state["position"] // per_step  # steps taken in the epoch of the checkpoint
    seen = [i for g in before[len(before) - done :] for r in g for i in r]
    resumed = [_loader(dataset, r, new_world, workers, batch) for r in range(new_world)]
    for loader in resumed:
        loader.load_state_dict(state)
    after: list[int] = []
    if resumed[0].state_dict()["epoch"] == epoch:  # else the epoch's rest is too short
        rest = [[_indices(b) for b in loader] for loader in resumed]
        after = [i for k in range(len(rest[0])) for r in range(new_world) for i in rest[r][k]]
    assert len(set(seen + after)) == len(seen) + len(after)  # nothing twice
    missing = len(dataset) - len(seen) - len(after)
    assert 0 <= missing < batch * new_world  # only the tail too short for a global batch
    order = ResumableSampler(len(dataset), 1, seed=5, rank=0, world_size=1).order(epoch)
    assert seen + after == order[: len(seen) + len(after)].tolist()
    # The next epoch is the one a run started on new_world ranks would have.
    fresh = [_loader(dataset, r, new_world, 0, batch) for r in range(new_world)]
    for loader in fresh:
        loader.load_state_dict({**state, "epoch": epoch + 1, "position": 0})
    assert [[_indices(b) for b in x] for x in resumed] == [[_indices(b) for b in x] for x in fresh]


def test_epochs_are_shuffled_by_seed_and_cover_every_full_batch() -> None:
    a = ResumableSampler(10, 3, seed=1, rank=0, world_size=1)
    e0, e1 = list(a), list(a)
    assert len(e0) == len(e1) == 3 and (a.epoch, a.position) == (2, 0)
    assert e0 != e1 and len({i for b in e0 for i in b}) == 9
    b = ResumableSampler(10, 3, seed=1, rank=0, world_size=1)
    assert list(b) == e0
    c = ResumableSampler(10, 3, seed=2, rank=0, world_size=1)
    assert list(c) != e0
    with pytest.raises(ValueError, match="the dataset or the sampler changed"):
        ResumableSampler(11, 3, seed=1, rank=0, world_size=1).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ResumableSampler(10, 3, rank=0, world_size=4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_through_a_checkpoint(
    dataset: TokenDataset, tmp_path: Path, workers: int
) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> DataLoader:
        sampler = ResumableSampler(dataset, 2, seed=3, rank=1, world_size=2)
        return stateful.StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=workers)

    uninterrupted = make()
    reference = [_indices(b) for _ in range(3) for b in uninterrupted]
    loader = make()
    done = [_indices(b) for b in loader]  # 13 batches
    it = iter(loader)
    done += [_indices(next(it)) for _ in range(4)]  # into the second epoch
    assert done == reference[:17]
    with unbroken.Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(17, {"data": loader})
    again = make()
    with unbroken.Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore({"data": again}) == 17
    rest = [_indices(b) for b in again] + [_indices(b) for b in again]
    assert rest == reference[17:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("saved", "live"), [(2, 3), (0, 2), (2, 0)])
def test_a_stateful_dataloader_restored_with_other_workers_is_refused_at_the_restore(
    dataset: TokenDataset, tmp_path: Path, saved: int, live: int
) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make(workers: int) -> DataLoader:
        sampler = ResumableSampler(dataset, 2, seed=3, rank=1, world_size=2)
        return stateful.StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=workers)

    loader = make(saved)
    it = iter(loader)
    next(it)
    with unbroken.Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(1, {"data": loader})
        message = f"num_workers={saved}, this one has num_workers={live}"
        with pytest.raises(CheckpointError, match=message):
            ckpt.restore({"data": make(live)})


@pytest.mark.timeout(90)
def test_a_checkpoint_from_two_ranks_restores_the_position_on_one(tmp_path: Path) -> None:
    path = _arange_file(tmp_path / "a.bin", 53)
    run_ranks(_save_at_step, path, tmp_path / "ck", world=2)
    # Saved after 2 global batches of 2 x 2 samples: the position is the same on both
    # ranks, so the Checkpointer restores it on any number of ranks (here one process,
    # with another batch size): the next batch is samples 8..10 of the epoch's order.
    sampler = ResumableSampler(53, 3, seed=9)
    loader = ResumableLoader(DataLoader(TokenDataset(path, SEQ), batch_sampler=sampler))
    with unbroken.Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore({"data": loader}) == 2
    order = ResumableSampler(53, 1, seed=9).order(0).tolist()
    assert _indices(next(iter(loader))) == order[8:11]


def _save_at_step(rank: int, world: int, path: Path, ckpt_dir: Path) -> None:
    sampler = ResumableSampler(53, 2, seed=9)  # rank and world size from the process group
    loader = ResumableLoader(DataLoader(TokenDataset(path, SEQ), batch_sampler=sampler))
    it = iter(loader)
    got = [_indices(next(it)) for _ in range(2)]
    order = sampler.order(0).tolist()
    assert got == [order[2 * rank : 2 * rank + 2], order[4 + 2 * rank : 6 + 2 * rank]]
    with unbroken.Checkpointer(ckpt_dir) as ckpt:
        ckpt.save(2, {"data": loader})


# --- token files ------------------------------------------------------------------------


def test_token_file_round_trips_and_pickles_without_its_tokens(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    ids = np.random.default_rng(0).integers(0, 65536, 100_000)
    with TokenWriter(path, "uint16") as w:
        w.append(ids[:500])
        w.append(ids[500:])
    assert path.stat().st_size == 200_000 and json.loads(sidecar(path).read_text())["tokens"]
    ds = TokenDataset([path, path], seq_len=99)
    assert len(ds) == 2 * (100_000 - 1) // 99 and ds.tokens == 200_000
    assert ds[1].tolist() == ids[99:199].tolist() and ds[1].dtype == torch.int64
    assert ds[len(ds) // 2].tolist() == ids[:100].tolist()  # the second file's first
    ds.verify()
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # names, not tokens: a worker maps the file itself
    assert torch.equal(pickle.loads(blob)[7], ds[7])
    with pytest.raises(IndexError):
        ds[len(ds)]


def _resident(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        view = ctypes.c_char.from_buffer(m)  # a private mapping: nothing is written back
        assert libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), size, vec) == 0
        del view
    return sum(v & 1 for v in vec) / pages


def test_opening_and_sampling_reads_only_the_pages_sampled(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    with TokenWriter(path, "uint16") as w:  # 64 MiB, fsynced: its pages can be evicted
        w.append(np.arange(32 << 20, dtype=np.uint32) % 50_000)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident(path) > 0.01:
        pytest.skip("this file system keeps the file in memory (tmpfs?)")
    ds = TokenDataset(path, 1024)
    worker_copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets
    assert _resident(path) == 0.0  # opening reads no token
    assert ds[len(ds) // 2][0] == (len(ds) // 2 * 1024) % 50_000
    assert worker_copy[7][0] == 7 * 1024
    # Two samples of 2 KiB each, and the kernel's read-ahead around them (8 MiB on the
    # VM this was written on), not the file.
    assert _resident(path) < 0.5


def _written(tmp_path: Path, n: int = 1000) -> Path:
    path = tmp_path / "t.bin"
    with TokenWriter(path, "uint16") as w:
        w.append(np.arange(n) % 300)
    return path


def test_truncated_or_extended_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = _written(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(1500)
    with pytest.raises(DataFileError, match=rf"{path}: truncated: it holds 1500 bytes.*1000"):
        TokenDataset(path, 8)
    with open(path, "ab") as f:
        f.write(b"\0" * 600)
    with pytest.raises(DataFileError, match=rf"{path}: longer than its sidecar says"):
        TokenDataset(path, 8)


def test_flipped_byte_passes_open_and_fails_verify(tmp_path: Path) -> None:
    path = _written(tmp_path)
    with open(path, "r+b") as f:
        f.seek(777)
        f.write(b"\xff")
    ds = TokenDataset(path, 8)  # open checks sizes only: re-attaching reads nothing
    with pytest.raises(DataFileError, match=rf"{path}: checksum mismatch"):
        ds.verify()
    assert cli(["tokenise", "--verify", str(path)]) == 1  # damage found


def test_too_short_missing_or_damaged_sidecar(tmp_path: Path) -> None:
    path = _written(tmp_path, 9)
    with pytest.raises(DataFileError, match=rf"{path}: too short: 9 tokens.*seq_len \+ 1 = 10"):
        TokenDataset(path, 9)
    assert len(TokenDataset(path, 8)) == 1
    saved = path.read_bytes()
    path.unlink()
    with pytest.raises(DataFileError, match=rf"{path}: no such token file \(its sidecar"):
        TokenDataset(path, 8)
    path.write_bytes(saved)
    sidecar(path).write_text('{"format": "unbroken.tokens", "version": 1, "dtype": "int8"}')
    with pytest.raises(DataFileError, match=r"t.bin.json: bad sidecar: dtype 'int8'"):
        TokenDataset(path, 8)
    sidecar(path).write_text("{not json")
    with pytest.raises(DataFileError, match=r"t.bin.json: damaged sidecar"):
        TokenDataset(path, 8)
    sidecar(path).unlink()
    with pytest.raises(DataFileError, match=rf"{path}: no sidecar"):
        TokenDataset(path, 8)
    with pytest.raises(DataFileError, match="id 70000 does not fit uint16"):
        TokenWriter(tmp_path / "big.bin").append([1, 70000])
    assert not (tmp_path / "big.bin").exists() and not list(tmp_path.glob(".big*"))


# --- tokenising -------------------------------------------------------------------------


def test_text_jsonl_parquet_and_arrow_give_the_same_tokens(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = ["Ünïcode ok", load_corpus()[:3000], "last"]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d, encoding="utf-8")
    lines = "\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs))
    (tmp_path / "d.jsonl").write_text(lines + "\n\n")
    table = pa.table({"body": docs})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    with (
        pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)

    txt = tokenise([tmp_path / f"{i}.txt" for i in range(3)], tmp_path / "txt.bin")
    assert (txt.documents, txt.tokens) == (3, sum(len(d.encode()) + 1 for d in docs))
    tokenise([tmp_path / "d.jsonl"], tmp_path / "jsonl.bin")
    tokenise([tmp_path / "d.parquet"], tmp_path / "pq.bin", field="body")
    tokenise([tmp_path / "d.arrow"], tmp_path / "arrow.bin", field="body")
    files = [
        unbroken.data.TokenFile.open(tmp_path / f"{n}.bin") for n in ("txt", "jsonl", "pq", "arrow")
    ]
    assert len({f.checksum for f in files}) == 1
    ids = files[0].tokens
    assert ByteTokenizer().decode(ids[: len(docs[0].encode())]) == docs[0]
    assert ids[len(docs[0].encode())] == ByteTokenizer.eos
    with pytest.raises(DataFileError, match="no column 'text'"):
        tokenise([tmp_path / "d.parquet"], tmp_path / "x.bin")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(DataFileError, match=r"bad.jsonl, line 2: not a JSON object with a 'text'"):
        tokenise([tmp_path / "bad.jsonl"], tmp_path / "x.bin")


def test_hugging_face_tokenizer_and_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    corpus = tmp_path / "c.txt"
    corpus.write_text(load_corpus())
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tokenise([corpus], tmp_path / "hf.bin", tok, eos=1)
    words = tok.encode(load_corpus()).ids
    assert out.tokens == len(words) + 1
    assert TokenDataset(out.path, 8)[0][:8].tolist() == words[:8]

    argv = ["tokenise", str(corpus), "-o", str(tmp_path / "cli.bin")]
    assert cli([*argv, "--tokenizer", str(tmp_path / "tokenizer.json"), "--eos", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "cli.bin").read_bytes() == out.path.read_bytes()
    assert cli(["tokenise", str(corpus), "-o", str(tmp_path / "cli.bin")]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli(["tokenise", "--verify", str(tmp_path / "cli.bin")]) == 0
