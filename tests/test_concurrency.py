"""Concurrency: two jobs saving to one path, retention deleting while other jobs restore,
two restores at once, snapshots taken while replicas are being received. Nothing
committed is ever corrupted or mixed, and what must be refused is refused clearly."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import time
from typing import Any

import pytest
import torch

from ranks import run_ranks
from unbroken import Checkpointer
from unbroken.errors import CheckpointError
from unbroken.format.layout import step_dir
from unbroken.run import faults
from unbroken.saving import claims
from unbroken.storage.local import LocalStorage

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


def _writer_or_reader(root: str, steps: int, role: int, out: Any) -> None:
    """Role 0 saves ``steps`` steps keeping only the newest (retention deletes every
    older step while the readers read); roles 1 and 2 restore the newest step over and
    over, at the same time as each other, until the writer is done."""
    torch.set_num_threads(1)
    path = os.path.join(root, "ckpt")
    if role == 0:
        ckpt = Checkpointer(path, keep=1)
        ckpt.save(1, value(0, 1))
        _gate(root, "start", 3)
        for step in range(2, steps + 1):
            ckpt.save(step, value(0, step))
        ckpt.close()
        open(os.path.join(root, "done"), "w").close()
        out.put((role, steps))
        return
    _gate(root, "start", 3)
    seen: dict[str, int] = {"whole": 0, "refused": 0, "mixed": 0}
    while not os.path.exists(os.path.join(root, "done")) or not seen["whole"]:
        state: dict[str, Any] = {"w": torch.zeros(SIZE), "meta": {}}
        try:
            got = Checkpointer(path).restore(state)
        except CheckpointError:  # the step it chose was deleted under it: said clearly
            seen["refused"] += 1
            continue
        whole = got is not None and torch.equal(state["w"], value(0, got)["w"])
        seen["whole" if whole and state["meta"] == {"job": 0, "step": got} else "mixed"] += 1
    out.put((role, seen))


@pytest.mark.timeout(120)
def test_restores_while_retention_deletes_get_whole_steps_or_a_clear_error(tmp_path):
    writer, *readers = _spawn(_writer_or_reader, str(tmp_path), 20, count=3)
    print(f"retention deleting 19 steps under two concurrent readers: {readers}")
    assert writer == 20
    for seen in readers:
        assert seen["mixed"] == 0 and seen["whole"] >= 1, readers


def _snapshots_while_receiving(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["UNBROKEN_NODE"] = str(rank)  # two simulated nodes
    shm = os.path.join(root, f"node-{rank}")

    def make() -> Checkpointer:
        path = os.path.join(root, "ckpt")
        return Checkpointer(path, memory=True, replicas=1, memory_dir=shm, job="j")

    ckpt = make()
    for step in range(1, 11):  # no wait: snapshot N+1 copies while N's replica travels
        ckpt.snapshot(step, {"w": torch.full((SIZE * 4,), float(rank * 100 + step))})
    ckpt.wait()
    ckpt.close()
    if rank == 1:  # node 1 is lost: its state comes back from node 0's replica of it
        shutil.rmtree(shm)
    fresh = {"w": torch.zeros(SIZE * 4)}
    replacement = make()
    got = replacement.restore(fresh)
    assert replacement.last_restore is not None
    origin = replacement.last_restore.origins[rank].kind
    replacement.close()
    return {"step": got, "origin": origin, "whole": torch.equal(fresh["w"], torch.full(
        (SIZE * 4,), float(rank * 100 + 10)))}  # fmt: skip


@pytest.mark.timeout(120)
def test_snapshots_taken_while_replicas_are_received_restore_whole(tmp_path):
    results = run_ranks(_snapshots_while_receiving, str(tmp_path), timeout=100)
    assert [r["step"] for r in results] == [10, 10]
    assert [r["origin"] for r in results] == ["memory", "replica"]
    assert all(r["whole"] for r in results), results


def test_a_save_that_lost_its_claim_leaves_the_new_owners_folder(tmp_path, monkeypatch):
    """Another writer takes over step 1's claim while this save writes it (as a job does
    when it finds the claim stale): the commit is refused, and the failed save leaves
    the folder, which is the other writer's now, as it finds it."""
    path = str(tmp_path / "ckpt")
    other = claims.Claim("other", "elsewhere", 1, time.time())
    claim_file = os.path.join(path, step_dir(1), claims.CLAIM)
    reached = faults.point

    def take_over(name: str) -> None:
        if name == "data-written":
            with open(claim_file, "w") as f:
                json.dump(dataclasses.asdict(other), f)
        reached(name)

    monkeypatch.setattr(faults, "point", take_over)
    with pytest.raises(CheckpointError, match="claim was removed or taken"):
        Checkpointer(path).save(1, value(0, 1))
    assert claims.read(LocalStorage(path), step_dir(1)) == other
    assert Checkpointer(path).steps() == []
