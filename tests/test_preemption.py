"""Preemption and save policies across real processes: a SIGTERM during training (to one
rank, as a scheduler's signals reach ranks at different moments) makes every rank save
the same step within the grace period and exit; resuming from it is bitwise exact. Clock
policies agree across ranks whose clocks differ."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

import unbroken
from ranks import run_ranks
from unbroken import Checkpointer
from unbroken.policies import Every, Policy
from unbroken.preemption import Preempted, Preemption

GRACE_S = 10.0
UNTIL = 80


def _model() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int, step: int) -> None:
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
    optim.zero_grad()
    model(data).pow(2).mean().backward()
    optim.step()


def _train(rank: int, world: int, root: str, signal_after: float | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, optim = _model()
    progress = unbroken.Progress(step=0)
    state = {"model": model, "optim": optim, "p": progress}
    policy = Policy(save=Every(seconds=0.1 + 0.05 * rank))  # rank 0's clock decides
    ckpt = Checkpointer(root, policy=policy, preemption=Preemption(grace_s=GRACE_S))
    start = ckpt.restore(state) or 0
    signalled: list[float] = []
    if signal_after is not None and rank == 0:

        def term() -> None:
            signalled.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Timer(signal_after, term).start()
    step = start
    try:
        for step in range(start + 1, UNTIL + 1):
            _step(model, optim, rank, step)
            progress.step = step
            time.sleep(0.01)
            ckpt.step(step, state)
    except Preempted as e:
        took = time.monotonic() - signalled[0] if signalled else None
        return {"preempted": step, "code": e.code, "took": took, "start": start}
    ckpt.close()
    return {"done": step, "start": start, "weight": model.weight.detach().tolist()}


@pytest.mark.timeout(150)
def test_sigterm_saves_within_the_grace_period_and_the_resume_is_bitwise_exact(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_ranks(_train, root, 0.3, timeout=60)
    stopped = first[0]["preempted"]
    assert [r["preempted"] for r in first] == [stopped, stopped]  # every rank, the same step
    assert 1 < stopped < UNTIL and first[0]["code"] == 0
    assert first[0]["took"] < GRACE_S
    steps = Checkpointer(root).steps()
    assert steps[-1] == stopped and len(steps) > 1  # the policy's saves, then preemption's
    resumed = run_ranks(_train, root, None, timeout=60)
    assert [r["start"] for r in resumed] == [stopped, stopped]
    for rank, result in enumerate(resumed):  # the same training, never interrupted
        model, optim = _model()
        for step in range(1, UNTIL + 1):
            _step(model, optim, rank, step)
        assert result["weight"] == model.weight.detach().tolist()
