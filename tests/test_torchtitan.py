"""unbroken.torchtitan: torchtitan's trainer with unbroken's checkpoint manager.

Two tiers. Fast, in this process: the manager built as torchtitan builds it (its own
optimizer and scheduler containers) saves, keeps, restores, excludes and carries state.
Real, several processes: torchtitan's own train loop (llama3 debugmodel, CPU, gloo)
under `unbroken run --in-process` with rank 1 killed, healed from the live replica and
bitwise equal to an uninterrupted run, then restored on one rank from two.

torchtitan is in the ``trainers`` extra; it runs on CPU with the shims of
examples/torchtitan/train.py (see its ``_on_cpu``).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from unbroken.torchtitan import CheckpointManager, DataPosition, carry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchtitan" / "train.py"


class Counters:
    """torchtitan's ``train_state`` (its Trainer): a step and a token count."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _job(tmp_path: Path, seed: int, **options):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=10
    )
    counters = Counters()
    options = {"memory": False, "replicas": 0, "snapshot_interval": 0, "heal": False} | options
    manager = CheckpointManager.Config(**options).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": counters},
        base_folder=str(tmp_path),
    )
    return model, optimizers, schedulers, counters, manager


def _train(job, steps: int) -> None:
    model, optimizers, schedulers, counters, manager = job
    for _ in range(steps):
        counters.step += 1
        x = torch.randn(4, 8)
        optimizers.zero_grad()
        model(x).pow(2).mean().backward()
        optimizers.step()
        schedulers.step()
        counters.ntokens_seen += 4
        manager.save(counters.step, last_step=False)


def test_saves_keeps_and_restores_through_torchtitans_containers(tmp_path):
    job = _job(tmp_path, 0, interval=2, keep_latest_k=2, async_save=True)
    model, _, schedulers, _, manager = job
    _train(job, 6)
    manager.maybe_wait_for_saving()
    manager.close()
    assert manager.ckpt.steps() == [4, 6]  # keep_latest_k
    model2, optim2, sched2, counters2, manager2 = _job(tmp_path, 1, interval=2)
    assert manager2.load() is True
    assert counters2.state_dict() == {"step": 6, "ntokens_seen": 24}
    assert sched2.state_dict() == schedulers.state_dict()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    inner, inner2 = job[1].optimizers[0], optim2.optimizers[0]
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(inner.state[p]["exp_avg"], inner2.state[p2]["exp_avg"])
    manager2.close()


def test_load_step_and_exclude_from_loading(tmp_path):
    job = _job(tmp_path, 0, interval=2)
    _train(job, 4)
    job[-1].close()
    _, _, sched, counters, manager = _job(
        tmp_path, 1, interval=2, load_step=2, exclude_from_loading=["lr_scheduler"]
    )
    assert manager.load(step=2) is True
    assert counters.step == 2
    assert sched.state_dict()["last_epoch"] == 0  # excluded: as built
    manager.close()


def test_nothing_to_load_and_disabled(tmp_path):
    *_, manager = _job(tmp_path, 0)
    assert manager.load() is False
    manager.close()
    *_, off = _job(tmp_path, 0, enable=False)
    assert off.load() is False and off.save(1) is False


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"snapshot_interval": -1}, "snapshot_interval"),
        ({"memory": False, "snapshot_interval": 2, "replicas": 0}, "memory=True"),
        ({"memory": False, "snapshot_interval": 0, "replicas": 1}, "replicas"),
        ({"last_save_in_hf": True, "last_save_model_only": True}, "unbroken export"),
        ({"keep_latest_k": 1}, "at least 2"),  # torchtitan's own check still runs
    ],
)
def test_config_says_why_a_value_is_wrong(options, why):
    with pytest.raises(ValueError, match=why):
        CheckpointManager.Config(**options)


class Fused(nn.Module):
    """Like torchtitan's fused QKV: its state dict gives new tensors, split from one."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Parameter(torch.randn(6, 4))
        self._register_state_dict_hook(Fused._split)

    @staticmethod
    def _split(module, sd, prefix, local_metadata):
        fused = sd.pop(prefix + "wqkv")
        for name, part in zip("qkv", fused.detach().clone().chunk(3), strict=True):
            sd[prefix + "w" + name] = part
        return sd


def test_carry_copies_parameters_and_optimizer_state_not_state_dict_copies():
    old, new = Fused(), Fused()
    opt_old = torch.optim.AdamW(old.parameters(), lr=0.1)
    old.wqkv.grad = torch.ones_like(old.wqkv)
    opt_old.step()
    opt_new = torch.optim.AdamW(new.parameters(), lr=0.5)
    carry({"model": old, "optimizer": opt_old}, {"model": new, "optimizer": opt_new})
    assert torch.equal(new.wqkv, old.wqkv)
    assert opt_new.param_groups[0]["lr"] == 0.1
    carried, kept = opt_new.state[new.wqkv]["exp_avg"], opt_old.state[old.wqkv]["exp_avg"]
    assert torch.equal(carried, kept) and carried.data_ptr() != kept.data_ptr()


def test_data_position_round_trips_without_pickle():
    loader = StatefulDataLoader(list(range(10)), batch_size=2)
    it = iter(loader)
    next(it), next(it)
    position = DataPosition(loader).state_dict()
    assert not any(isinstance(v, bytes) for v in position.values())
    again = StatefulDataLoader(list(range(10)), batch_size=2)
    DataPosition(again).load_state_dict(position)
    assert next(iter(again)).tolist() == [4, 5]
    assert DataPosition(None).state_dict() == {}


# -- torchtitan's own train loop, several processes ------------------------------------


def documented() -> list[list[str]]:
    """The commands examples/torchtitan/train.py's docstring gives, as argument lists."""
    doc = (ast.get_docstring(ast.parse(EXAMPLE.read_text())) or "").replace("\\\n", " ")
    return [shlex.split(line) for line in doc.splitlines() if line.strip().startswith("unbroken")]


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def _digests(out: str, step: int) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(rf"rank (\d+): step {step} params (\w+)", out)}


@pytest.mark.timeout(480)
def test_torchtitan_heals_a_killed_rank_from_its_live_replica_bitwise(tmp_path):
    """The docstring's commands as printed, from a folder like a fresh clone's; and the
    first once more without its fault, to compare the parameters with."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    heal, reshard = documented()
    at = heal.index("--inject-fault")
    clean = heal[:at] + heal[at + 2 :]
    clean[clean.index("--dump_folder") + 1] = "runs/clean"
    uninterrupted = _run(clean, tmp_path)
    healed = _run(heal, tmp_path)
    assert "healed step 5 from live replicas" in healed, healed[-4000:]
    assert "first step after recovery: step 6" in healed  # nothing redone
    assert len(set(_digests(uninterrupted, 8).values())) == 1
    assert _digests(healed, 8) == _digests(uninterrupted, 8)  # bitwise: the same parameters
    out = _run(reshard, tmp_path)  # saved on 2 ranks, restored on 1
    assert re.search(r"restored step 8 \((storage|memory)\)", out), out[-4000:]
    assert re.search(r"rank 0: step 12 params \w+", out)
