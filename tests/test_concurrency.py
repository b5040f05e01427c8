"""Concurrency: two jobs saving to one path, retention deleting while other jobs restore,
two restores at once, snapshots taken while replicas are being received. Nothing
committed is ever corrupted or mixed, and what must be refused is refused clearly."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import pytest
import torch

from unbroken import Checkpointer
from unbroken.errors import CheckpointError

SIZE = 1 << 18  # 1 MiB a tensor: saves take long enough to overlap


def value(job: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(job * 1000 + step)
    return {"w": torch.randn(SIZE, generator=g), "meta": {"job": job, "step": step}}


def whose(path: str, step: int) -> int:
    """Which job's state ``step`` holds, checked bitwise; -1 if neither's."""
    state: dict[str, Any] = {"w": torch.zeros(SIZE), "meta": {}}
    Checkpointer(path).restore(state, step=step)
    job = state["meta"].get("job", -1)
    want = value(job, step)
    return job if torch.equal(state["w"], want["w"]) and state["meta"] == want["meta"] else -1


def _gate(root: str, name: str, count: int) -> None:
    """Wait until ``count`` processes reached this gate (they start at different times)."""
    open(os.path.join(root, f"{name}-{os.getpid()}"), "w").close()
    while len([f for f in os.listdir(root) if f.startswith(f"{name}-")]) < count:
        time.sleep(0.005)


def _saving_job(root: str, steps: int, job: int, out: Any) -> None:
    torch.set_num_threads(1)
    ckpt = Checkpointer(os.path.join(root, "ckpt"))
    _gate(root, "start", 2)
    outcome = []
    for step in range(1, steps + 1):
        try:
            ckpt.save(step, value(job, step))
            outcome.append([step, "saved"])
        except CheckpointError as e:
            outcome.append([step, str(e)])
    ckpt.close()
    out.put((job, outcome))


def _spawn(target: Any, *args: Any, count: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, i, out)) for i in range(count)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [r for _, r in sorted(results)]


REFUSALS = (
    "being saved by another",
    "another job",
    "committed by another writer",
    "is already committed",
    "below the newest committed step",
)


@pytest.mark.timeout(120)
def test_two_jobs_saving_to_one_path_never_corrupt_a_step_and_the_loser_is_told(tmp_path):
    root, steps = str(tmp_path), 6
    outcomes = _spawn(_saving_job, root, steps, count=2)  # jobs 0 and 1
    path = os.path.join(root, "ckpt")
    committed = Checkpointer(path).steps()
    assert committed, outcomes
    for step in committed:
        assert whose(path, step) in (0, 1), f"step {step} is neither job's, bitwise"
    for job, outcome in enumerate(outcomes):
        for step, result in outcome:
            if result == "saved":
                assert whose(path, step) == job, f"job {job}'s saved step {step} is not its own"
            else:
                assert any(r in result for r in REFUSALS), result
    print(f"two jobs, one path: {outcomes}")
