"""unbroken.lightning.CheckpointIO under real Lightning Trainers on the CPU: a run
interrupted and resumed (one process, two DDP processes, S3) ends with the same weights,
bit for bit, as one never interrupted; ModelCheckpoint's top-k and last.ckpt keep and
delete what they should; a value that needs pickle is refused, naming its key."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn

import unbroken
from unbroken.errors import CheckpointError
from unbroken.lightning import CheckpointIO

EXAMPLE = Path(__file__).parent.parent / "examples" / "lightning.py"
# Loaded under another name: as `lightning` it would hide the `lightning` package.
_spec = importlib.util.spec_from_file_location("lightning_example", EXAMPLE)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


class Crash(Callback):
    """Raises as epoch ``epoch`` starts: the checkpoints of the epochs before it exist."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("simulated crash")


def fit(io, epochs, ckpt_path=None, callbacks=(), model=None):
    pl.seed_everything(0, verbose=False)
    model = model or example.Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        plugins=[io],
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, example.loader(0), example.loader(1), ckpt_path=ckpt_path)
    return trainer, model


def top2(path):
    return ModelCheckpoint(
        dirpath=path, monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}"
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Weights after 4 epochs without interruption, and the ModelCheckpoint that ran."""
    path = tmp_path_factory.mktemp("uninterrupted")
    best = top2(path)
    _, model = fit(CheckpointIO(), 4, callbacks=[best])
    return [p.detach().clone() for p in model.parameters()], best, path


def same(model, weights):
    return all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_crashed_run_resumes_from_last_to_identical_weights(tmp_path, uninterrupted, async_save):
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(CheckpointIO(async_save=async_save), 4, callbacks=[top2(tmp_path), Crash(2)])
    last = tmp_path / "last.ckpt"
    io = CheckpointIO(async_save=async_save)
    assert io.load_checkpoint(last)["epoch"] == 1
    trainer, model = fit(io, 4, ckpt_path=last, callbacks=[top2(tmp_path)])
    assert trainer.current_epoch == 4 and trainer.global_step == 32
    assert same(model, uninterrupted[0])
    if async_save:  # staged through one reusable host buffer
        assert io._stager.nbytes > 0


def test_model_checkpoint_keeps_the_top_k_and_last(uninterrupted):
    _, best, path = uninterrupted
    kept = {os.path.basename(p) for p in best.best_k_models}
    assert len(kept) == 2 and best.best_model_path
    # Four epochs were saved; the two worst were removed through remove_checkpoint.
    assert sorted(os.listdir(path)) == sorted([*kept, "last.ckpt"])
    assert kept < {f"epoch={e}.ckpt" for e in range(4)}
    # last.ckpt was replaced at every epoch: each save a new step, the older one deleted.
    assert unbroken.Checkpointer(path / "last.ckpt").steps() == [3]
    loaded = CheckpointIO().load_checkpoint(best.best_model_path)
    assert loaded["callbacks"][best.state_key]["best_model_path"] == best.best_model_path
    assert loaded["hyper_parameters"] == {"hidden": 16, "lr": 0.05}
    assert isinstance(loaded["optimizer_states"][0]["param_groups"][0]["params"], list)


def test_load_from_checkpoint_reads_a_checkpoint_through_checkpoint_file(uninterrupted):
    weights, _, path = uninterrupted
    with pytest.raises(IsADirectoryError):  # Lightning's classmethod skips the plugin
        example.Regression.load_from_checkpoint(path / "last.ckpt")
    model = example.Regression.load_from_checkpoint(
        unbroken.lightning.checkpoint_file(path / "last.ckpt")
    )
    assert same(model, weights)


def test_save_last_as_a_link_points_at_the_newest_checkpoint(tmp_path):
    best = ModelCheckpoint(dirpath=tmp_path, save_top_k=1, monitor="val_loss", save_last="link")
    fit(CheckpointIO(), 2, callbacks=[best])
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and len(list(tmp_path.iterdir())) == 2
    assert CheckpointIO().load_checkpoint(last)["epoch"] == 1
    CheckpointIO().remove_checkpoint(last)  # the link only
    assert not last.exists() and CheckpointIO().exists(best.best_model_path)


@pytest.mark.timeout(120)
def test_s3_async_save_resume_and_remove(bucket, uninterrupted):
    url, options = bucket
    path = f"{url}/epoch=1.ckpt"
    io = CheckpointIO(async_save=True, storage_options=options)
    trainer, _ = fit(io, 2)
    trainer.save_checkpoint(path)
    assert io.exists(path) and not io.exists(f"{url}/other.ckpt")
    _, model = fit(CheckpointIO(storage_options=options), 4, ckpt_path=path)
    assert same(model, uninterrupted[0])
    io.remove_checkpoint(path)
    assert not io.exists(path)
    assert unbroken.storage.open_storage(url, options).list("") == []


class WithLoss(pl.LightningModule):
    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(2, 1)


def test_a_value_that_needs_pickle_is_refused_naming_its_key(tmp_path):
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"loss": nn.L1Loss()}}
    with pytest.raises(CheckpointError, match=r"'hyper_parameters/loss' holds a torch\.nn"):
        CheckpointIO().save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    # Through a Trainer: save_hyperparameters() put the module in the checkpoint.
    trainer = pl.Trainer(accelerator="cpu", plugins=[CheckpointIO()], logger=False)
    trainer.strategy.connect(WithLoss(nn.L1Loss()))
    with pytest.raises(CheckpointError, match="'hyper_parameters/loss'"):
        trainer.save_checkpoint(tmp_path / "b.ckpt")
    # Opting in stores it; loading it needs the same opt-in.
    CheckpointIO(allow_pickle=True).save_checkpoint(checkpoint, tmp_path / "c.ckpt")
    with pytest.raises(CheckpointError, match="'hyper_parameters/loss' was stored with pickle"):
        CheckpointIO().load_checkpoint(tmp_path / "c.ckpt")
    loaded = CheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "c.ckpt")
    assert isinstance(loaded["hyper_parameters"]["loss"], nn.L1Loss)
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2))


def test_a_torch_save_file_is_named_as_written_by_another_checkpoint_io(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "x.ckpt")
    with pytest.raises(CheckpointError, match="another CheckpointIO wrote it"):
        CheckpointIO().load_checkpoint(tmp_path / "x.ckpt")
    with pytest.raises(FileNotFoundError):
        CheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")


def run_example(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.timeout(300)
def test_ddp_two_processes_resume_to_identical_weights(tmp_path):
    """Two ranks (gloo): 2 epochs, then a rerun to 4 resumes from last.ckpt, and ends
    with the weights of a 4-epoch run never stopped."""
    whole = run_example(f"--dir={tmp_path / 'whole'}", "--devices=2", "--epochs=4")
    first = finish(run_example(f"--dir={tmp_path / 'cut'}", "--devices=2", "--epochs=2"))
    assert "started fresh" in first
    again = finish(run_example(f"--dir={tmp_path / 'cut'}", "--devices=2", "--epochs=4"))
    assert "resumed from" in again
    weights = [re.search(r"finished at epoch 4, weights (\w+)", o) for o in (finish(whole), again)]
    assert all(weights) and weights[0][1] == weights[1][1]  # type: ignore[index]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_background_save_writes_on_one_thread_a_foreground_one_on_io_threads(
    tmp_path, monkeypatch, async_save
):
    """As `Checkpointer.save`'s: a background save takes a core at most beside the loop;
    a foreground one, which the loop waits for, spreads over ``io_threads``."""
    from unbroken.format import shards
    from unbroken.storage.local import LocalStorage

    threads: set[int] = set()
    write = LocalStorage.write

    def writing(self, path, parts):
        if path.endswith(".safetensors"):  # a shard file, not the manifest or info
            threads.add(threading.get_ident())
            time.sleep(0.05)  # long enough for a second worker to take the next file
        return write(self, path, parts)

    monkeypatch.setattr(LocalStorage, "write", writing)
    monkeypatch.setattr(shards, "FILE_BYTES", 1024)  # a file per tensor: several to write
    io = CheckpointIO(async_save=async_save, io_threads=2)
    checkpoint = {"state_dict": {f"w{i}": torch.full((512,), float(i)) for i in range(6)}}
    io.save_checkpoint(checkpoint, tmp_path / "ckpt")
    io.teardown()
    loaded = io.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in checkpoint["state_dict"].items())
    assert (len(threads) == 1) if async_save else (len(threads) >= 2), threads
