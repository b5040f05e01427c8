"""transformers' Trainer and Accelerate through unbroken (`unbroken.hf`): a resumed run
ends with the parameters of an uninterrupted one, bit for bit, mid-epoch included."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import unbroken
from unbroken.hf import accelerate as hf_accelerate
from unbroken.hf.trainer import Checkpointing, saved_state
from unbroken.policies import Every, Policy

ROOT = Path(__file__).resolve().parent.parent


def _prepared() -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1 / (1 + s))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    model, optim, loader, sched = accelerator.prepare(model, optim, loader, sched)
    return accelerator, model, optim, loader, sched


def _train(prepared, until: int, done: int = 0, save=None) -> int:
    """Micro-batches ``done+1..until`` across epochs; ``save(n)`` after micro-batch n."""
    accelerator, model, optim, loader, sched = prepared
    while done < until:
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward((model(x) - y).pow(2).mean())
                optim.step()
                sched.step()
                optim.zero_grad()
            done += 1
            if save is not None:
                save(done)
            if done == until:
                break
    return done


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_accelerate_resumes_mid_epoch_bitwise(where, tmp_path, request):
    path, options = (str(tmp_path / "ckpt"), None)
    if where == "s3":
        path, options = request.getfixturevalue("bucket")
    reference = _prepared()
    _train(reference, 40)  # 16 micro-batches an epoch: ends inside the third

    first = _prepared()
    ckpt = unbroken.Checkpointer(path, storage_options=options)
    saved = lambda n: n == 22 and hf_accelerate.save_state(first[0], ckpt, n)  # noqa: E731
    _train(first, 23, save=saved)  # one micro-batch past the save: it is lost
    ckpt.close()

    resumed = _prepared()
    ckpt = unbroken.Checkpointer(path, storage_options=options)
    step = hf_accelerate.load_state(resumed[0], ckpt)
    ckpt.close()
    assert step == 22
    _train(resumed, 40, done=22)
    for got, want in zip(_params(resumed[1]), _params(reference[1]), strict=True):
        assert torch.equal(got, want)
    assert resumed[4].state_dict() == reference[4].state_dict()


class _Crash(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 10:
            raise RuntimeError("crash at step 10")


class _Trainer(Checkpointing, Trainer):
    pass


def _trainer(path: Path, *callbacks: TrainerCallback, **options: Any) -> _Trainer:
    """A tiny Llama with dropout; the Trainer makes its optimizer and scheduler, so the
    tensors are restored once they exist, after the TrainerState."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (12, 16), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=str(path / "trainer"), use_cpu=True, max_steps=14,
        per_device_train_batch_size=2, warmup_steps=2, save_steps=4, seed=0, logging_steps=1,
        report_to="none", disable_tqdm=True,
    )  # fmt: skip
    data = [{"input_ids": t, "labels": t} for t in tokens]
    ckpt = unbroken.Checkpointer(path / "ckpt", keep=1, **options)
    model = LlamaForCausalLM(config)
    return _Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks),
                    checkpointer=ckpt)  # fmt: skip


def test_the_trainer_resumes_from_storage_mid_epoch_bitwise(tmp_path):
    """6 steps an epoch; crashed at step 10, resumed from the save of step 8."""
    reference = _trainer(tmp_path / "reference")
    reference.train()
    crashed = _trainer(tmp_path / "run", _Crash())
    with pytest.raises(RuntimeError, match="crash at step 10"):
        crashed.train(resume_from_checkpoint=True)
    crashed.checkpointer.close()
    assert crashed.checkpointer.steps() == [8]  # keep=1
    resumed = _trainer(tmp_path / "run")
    resumed.train(resume_from_checkpoint=True)
    for got, want in zip(resumed.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(got, want)
    losses = lambda t: [(h["step"], h["loss"]) for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(resumed) == losses(reference)  # 1-8 restored with the TrainerState
    assert [step for step, _ in losses(resumed)] == list(range(1, 15))


def test_a_step_records_history_is_bounded_and_a_resume_joins_it_to_a_save(tmp_path):
    """Every step's snapshot holds the TrainerState with only the log entries after the
    save before the newest (the history grows with the run; a record must not). Crashed
    at step 10, the run resumes from the snapshot of step 9 in memory: its history is
    the save of step 8's (keep=1: step 4's is gone) joined to step 9's entry, and the
    whole run's history and parameters are the uninterrupted run's."""
    snapshots = {"memory": True, "memory_dir": str(tmp_path / "shm")}
    policy = Policy(snapshot=Every(steps=1))
    reference = _trainer(tmp_path / "reference")
    reference.train()
    crashed = _trainer(tmp_path / "run", _Crash(), policy=policy, **snapshots)
    with pytest.raises(RuntimeError, match="crash at step 10"):
        crashed.train(resume_from_checkpoint=True)
    record = json.loads(crashed._recorded()["trainer"])
    assert record["unbroken_log_since"] == 4  # saves began at 4 and 8: 8 may not commit
    assert [h["step"] for h in record["log_history"]] == [5, 6, 7, 8, 9]
    crashed.checkpointer.wait()
    assert crashed.checkpointer.steps() == [8]
    resumed = _trainer(tmp_path / "run", policy=policy, **snapshots)
    resumed.train(resume_from_checkpoint=True)
    restored = resumed.checkpointer.last_restore
    assert restored is not None and (restored.step, restored.origin.kind) == (9, "memory")
    for got, want in zip(resumed.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(got, want)
    losses = lambda t: [(h["step"], h["loss"]) for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(resumed) == losses(reference)
    assert [step for step, _ in losses(resumed)] == list(range(1, 15))


def test_a_save_without_a_trainer_state_is_passed_over_when_joining_a_history(tmp_path):
    """Saves made in the Trainer's folder by other code hold no TrainerState (or one
    that is not one): the join of a record's history passes over them."""
    ckpt = unbroken.Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, {"w": torch.ones(2)})
    ckpt.save(2, {"w": torch.ones(2), "trainer": "not JSON"})
    ckpt.save(3, {"w": torch.ones(2), "trainer": json.dumps({"log_history": "no"})})
    ckpt.save(4, {"trainer": json.dumps({"log_history": [{"step": 4}]})})
    found = [saved_state(ckpt.manifest(step).objects_for(0)) for step in (1, 2, 3, 4)]
    ckpt.close()
    assert found == [None, None, None, {"log_history": [{"step": 4}]}]


def _example(run_dir: Path, *options: str) -> tuple[str, dict]:
    """`unbroken run OPTIONS examples/hf_trainer.py`: its output and its timeline."""
    timeline = run_dir.parent / f"{run_dir.name}.json"
    command = [sys.executable, "-m", "unbroken", "run", f"--timeline-json={timeline}", *options]
    command += [str(ROOT / "examples/hf_trainer.py"), "--dir", str(run_dir)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(timeline.read_text())


@pytest.mark.timeout(480)
def test_the_trainer_heals_a_killed_rank_in_process_bitwise(tmp_path):
    """Killed at step 10, rank 1 alone starts again and takes step 10 from rank 0's live
    state; no step is trained twice, and the parameters and every logged loss are the
    uninterrupted run's (rank 0 is healthy, but its Trainer is new: its history is restored)."""
    fault = "kill rank=1 step=10"
    healed, timeline = _example(
        tmp_path / "healed", "--in-process", "--simulate-nodes=2", "--nproc-per-node=1",
        "--max-restarts=1", f"--inject-fault={fault}",
    )  # fmt: skip
    [recovery] = timeline["recoveries"]
    assert (recovery["respawned"], recovery["first_step"], recovery["steps_redone"]) == ([1], 11, 0)
    clean, _ = _example(tmp_path / "clean", "--nproc-per-node=2")
    ends = [
        re.findall(r"finished at step 16, parameters (\w+), 16 losses logged (\w+)", out)
        for out in (healed, clean)
    ]
    assert ends[0] and ends[0] == ends[1]  # the parameters, and every step's logged loss
