"""Tier 0: snapshots in node-local shared memory, and restoring from them."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import unbroken
from conftest import make_model, train_steps
from ranks import run_ranks
from unbroken import Checkpointer, CheckpointError
from unbroken.format.layout import step_dir
from unbroken.memory.paths import folder_name
from unbroken.memory.tier import partners
from unbroken.run.contract import owner_text


def _state(seed=0):
    model = make_model(seed)
    return {
        "model": model,
        "optim": torch.optim.Adam(model.parameters()),
        "p": unbroken.Progress(step=0),
    }


def _ckpt(tmp_path, job="job-a", **kwargs):
    return Checkpointer(
        tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "shm"), job=job, **kwargs
    )


def _weights(state):
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def _slot_of(rank_dir, step):
    """The JSON file describing the slot that holds ``step``."""
    for path in sorted(map(str, Path(rank_dir).glob("slot-*.json"))):
        with open(path) as f:
            if json.loads(json.load(f)["manifest"])["step"] == step:
                return path
    raise AssertionError(f"no slot holds step {step}")


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_crashed_process_restores_from_memory_without_touching_storage(tmp_path):
    script = textwrap.dedent(
        f"""
        import json, os, signal, sys, torch, unbroken
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import make_model, train_steps
        model = make_model(0)
        optim = torch.optim.Adam(model.parameters())
        ckpt = unbroken.Checkpointer({str(tmp_path / "ckpt")!r}, memory=True,
                                     memory_dir={str(tmp_path / "shm")!r}, job="job-a")
        train_steps(model, optim, 3)
        ckpt.snapshot(3, {{"model": model, "optim": optim}})
        ckpt.wait()  # published: the checksum and the slot's JSON come in the background
        print(json.dumps(model[0].weight.flatten().tolist()), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == -signal.SIGKILL, run.stderr
    expected = torch.tensor(json.loads(run.stdout))
    state = _state(seed=5)
    del state["p"]
    ckpt = _ckpt(tmp_path)
    assert ckpt.restore(state) == 3
    assert ckpt.last_restore is not None and ckpt.last_restore.origin == unbroken.Origin(
        "memory", 3
    )
    assert torch.equal(state["model"][0].weight.flatten(), expected)
    assert len(state["optim"].state) == 4  # optimizer state came back too
    assert not (tmp_path / "ckpt").exists() or os.listdir(tmp_path / "ckpt") == []


def test_two_slots_a_damaged_newest_falls_back_to_the_other(tmp_path):
    ckpt = _ckpt(tmp_path)
    state = _state()
    seen = {}
    for step in (1, 2, 3):
        train_steps(state["model"], state["optim"], 1)
        ckpt.snapshot(step, state)
        ckpt.wait()  # each published before the next: two slots suffice, and alternate
        seen[step] = _weights(state)
    rank_dir = tmp_path / "shm" / folder_name("job-a") / "rank-00000"
    assert sorted(os.listdir(rank_dir)) == [
        "slot-0.bin",
        "slot-0.json",
        "slot-1.bin",
        "slot-1.json",
    ]
    assert sorted(ckpt._memory.snapshots()) == [2, 3]
    newest = Path(_slot_of(rank_dir, 3))
    data = newest.with_suffix(".bin")
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF  # a bit flip in step 3's copy
    data.write_bytes(raw)
    fresh = _state(seed=9)
    assert _ckpt(tmp_path).restore(fresh) == 2
    assert _equal(_weights(fresh), seen[2])


def test_a_half_written_slot_is_never_used(tmp_path):
    ckpt = _ckpt(tmp_path)
    state = _state()
    ckpt.snapshot(1, state)
    train_steps(state["model"], state["optim"], 1)
    ckpt.snapshot(2, state)
    ckpt.wait()
    rank_dir = tmp_path / "shm" / folder_name("job-a") / "rank-00000"
    # A crash while step 3 is copied: its slot (step 1's) has lost its description.
    victim = _slot_of(rank_dir, 1)
    os.unlink(victim)
    assert sorted(_ckpt(tmp_path)._memory.snapshots()) == [2]


def test_another_jobs_or_ranks_memory_is_never_used(tmp_path):
    first = _ckpt(tmp_path, job="job-a")
    first.snapshot(4, _state())
    first.wait()
    assert _ckpt(tmp_path, job="job-b").restore(_state()) is None  # a different job
    rank_dir = tmp_path / "shm" / folder_name("job-a") / "rank-00000"
    header = rank_dir / "slot-0.json"
    raw = json.loads(header.read_text())
    raw["rank"] = 1  # a region that claims to belong to another rank
    header.write_text(json.dumps(raw))
    assert _ckpt(tmp_path, job="job-a").restore(_state()) is None


def test_storage_wins_when_newer_memory_wins_when_newer(tmp_path):
    ckpt = _ckpt(tmp_path)
    state = _state()
    ckpt.snapshot(5, state)
    train_steps(state["model"], state["optim"], 1)
    ckpt.save(6, state)  # newer on storage: memory's step 5 is stale
    at_six = _weights(state)
    fresh = _state(seed=3)
    assert _ckpt(tmp_path).restore(fresh) == 6 and _equal(_weights(fresh), at_six)
    train_steps(state["model"], state["optim"], 1)
    ckpt.snapshot(7, state)
    ckpt.wait()
    fresh = _state(seed=3)
    assert _ckpt(tmp_path).restore(fresh) == 7 and _equal(_weights(fresh), _weights(state))
    older = _ckpt(tmp_path)
    assert older.restore(_state(), step=6) == 6  # an older step from storage
    assert older.last_restore is not None and older.last_restore.origin.kind == "storage"
    assert (tmp_path / "ckpt" / step_dir(7)).exists() is False


def test_abandoned_jobs_memory_is_cleaned_up(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    old = tmp_path / "shm" / "old-job"
    (old / "rank-00000").mkdir(parents=True)
    (old / "owner-00000").write_text(owner_text(int(dead.stdout)))
    live = tmp_path / "shm" / "live-job"
    (live / "rank-00000").mkdir(parents=True)
    (live / "owner-00000").write_text(owner_text(os.getpid()))
    _ckpt(tmp_path, job="job-a")
    assert sorted(os.listdir(tmp_path / "shm")) == sorted([folder_name("job-a"), "live-job"])


def test_snapshot_needs_memory_on():
    with pytest.raises(CheckpointError, match="memory=True"):
        Checkpointer("/tmp/unused-unbroken").snapshot(1, {})


def _ranks_job(
    rank: int, world: int, path: str, shm: str, reads: Literal["each", "broadcast"]
) -> tuple[int | None, list[float]]:
    ckpt = unbroken.Checkpointer(
        path, memory=True, memory_dir=shm, job="dist", replicated_reads=reads
    )
    state = {"w": torch.full((4,), float(rank))}
    ckpt.snapshot(1, state)
    state["w"] += 1
    ckpt.snapshot(2, state)
    ckpt.wait()
    if rank == 1:  # rank 1 lost step 2 (its slot was being rewritten when it died)
        assert ckpt._memory is not None
        os.unlink(_slot_of(ckpt._memory.dir, 2))
    state["w"].zero_()
    step = ckpt.restore(state)
    return step, state["w"].tolist()


@pytest.mark.parametrize("reads", ["each", "broadcast"])
def test_ranks_restore_the_newest_step_every_rank_holds(tmp_path, reads):
    # Each rank's values are its own: from memory, none is broadcast from rank 0's copy,
    # whatever replicated_reads says for storage.
    results = run_ranks(_ranks_job, str(tmp_path / "ckpt"), str(tmp_path / "shm"), reads)
    assert results == [(1, [0.0] * 4), (1, [1.0] * 4)]


@pytest.mark.parametrize(
    ("nodes", "copies", "expected"),
    [
        (["a", "a", "b", "b"], 1, [[2], [3], [0], [1]]),  # the same local index, next node
        (["a", "b", "c"], 2, [[1, 2], [2, 0], [0, 1]]),  # two replicas, two other nodes
        (["a", "a", "a", "b"], 1, [[3], [3], [3], [0]]),  # uneven nodes
        (["a", "a"], 1, [[1], [0]]),  # one node: another rank of it
        (["a"], 1, [[]]),  # alone: nobody to keep a replica
        (["a", "b"], 3, [[1], [0]]),  # no more copies than other nodes
    ],
)
def test_replica_partners(nodes, copies, expected):
    assert [partners(nodes, r, copies) for r in range(len(nodes))] == expected
    for rank, chosen in enumerate(expected):
        if len(set(nodes)) > 1:
            assert all(nodes[p] != nodes[rank] for p in chosen)  # never on its own node


def _replicated(root: str, shm: str) -> Checkpointer:
    path = os.path.join(root, "ckpt")
    return Checkpointer(path, memory=True, replicas=1, memory_dir=shm, job="j")


def _node_loss_job(rank: int, world: int, root: str) -> dict:
    import shutil

    node = rank // 2  # 4 ranks as 2 simulated nodes, each with its own shared memory
    os.environ["UNBROKEN_NODE"] = str(node)
    shm = os.path.join(root, f"node-{node}")

    def make() -> Checkpointer:
        return Checkpointer(
            os.path.join(root, "ckpt"), memory=True, replicas=1, memory_dir=shm, job="j"
        )

    ckpt = make()
    state: dict[str, Any] = {"w": torch.full((1000,), float(rank)), "p": unbroken.Progress(step=0)}
    for step in (1, 2, 3):
        state["w"] += 1
        state["p"].step = step
        ckpt.snapshot(step, state)
    ckpt.wait()  # replicas are in place
    expected = state["w"].clone()
    if node == 1:  # node 1 dies: its processes and all its shared memory
        shutil.rmtree(shm, ignore_errors=True)
        del ckpt
        state = {"w": torch.zeros(1000), "p": unbroken.Progress(step=0)}
    replacement = make()
    restored = replacement.restore(state)
    assert replacement.last_restore is not None
    return {
        "restored": restored,
        "origins": [[o.kind, o.step, o.peer] for o in replacement.last_restore.origins],
        "equal": torch.equal(state["w"], expected),
        "progress": state["p"].step,
        "partner": replacement._placement.partners,
        "storage": os.path.exists(os.path.join(root, "ckpt")),
    }


def test_a_lost_node_comes_back_from_peer_replicas(tmp_path):
    results = run_ranks(_node_loss_job, str(tmp_path), world=4, timeout=120)
    assert [r["restored"] for r in results] == [3, 3, 3, 3]
    assert all(r["equal"] and r["progress"] == 3 for r in results)
    assert [r["partner"] for r in results] == [[2], [3], [0], [1]]
    # Every rank reads the same account: node 0 from its memory, node 1 from its partners.
    origins = [["memory", 3, None], ["memory", 3, None], ["replica", 3, 0], ["replica", 3, 1]]
    assert all(r["origins"] == origins for r in results)
    assert not any(r["storage"] for r in results)  # nothing came from storage


def _incomplete_job(rank: int, world: int, root: str) -> int | None:
    node = rank  # 2 ranks, 2 nodes
    os.environ["UNBROKEN_NODE"] = str(node)
    shm = os.path.join(root, f"node-{node}")
    ckpt = Checkpointer(
        os.path.join(root, "ckpt"), memory=True, replicas=1, memory_dir=shm, job="j"
    )
    state = {"w": torch.ones(10)}
    ckpt.snapshot(1, state)
    ckpt.snapshot(2, state)
    ckpt.wait()
    run_ranks_barrier(root, rank, world)  # both ranks hold both steps before the damage
    if rank == 1:  # node 1 lost, and node 0's replica of it at step 2 is damaged
        import shutil

        shutil.rmtree(shm)
        replica = os.path.join(root, "node-0", folder_name("j"), "replicas", "rank-00001")
        os.unlink(_slot_of(replica, 2))
    return Checkpointer(
        os.path.join(root, "ckpt"), memory=True, replicas=1, memory_dir=shm, job="j"
    ).restore(state)


def test_a_step_not_complete_on_every_rank_is_never_used(tmp_path):
    assert run_ranks(_incomplete_job, str(tmp_path), timeout=120) == [1, 1]


def _renumbered_job(rank: int, world: int, root: str) -> dict:
    """4 ranks on 2 simulated nodes; node 0 (ranks 0, 1) dies and the job restarts with
    the survivor renumbered: its processes become ranks 0 and 1 and the replacement
    node's ranks 2 and 3 (as torchrun orders a replacement host differently)."""
    import shutil

    def on(node: int) -> Checkpointer:
        os.environ["UNBROKEN_NODE"] = str(node)
        shm = os.path.join(root, f"node-{node}")
        return Checkpointer(
            os.path.join(root, "ckpt"), memory=True, replicas=1, memory_dir=shm, job="j"
        )

    ckpt = on(rank // 2)
    state: dict[str, Any] = {"w": torch.full((1000,), float(rank)), "p": unbroken.Progress(step=0)}
    for step in (1, 2, 3):
        state["w"] += 1
        state["p"].step = step
        ckpt.snapshot(step, state)
    ckpt.wait()
    ckpt.close()
    if rank < 2:
        shutil.rmtree(os.path.join(root, "node-0"), ignore_errors=True)
    run_ranks_barrier(root, rank, world)
    # Restarted: rank r now runs on node 1 if r < 2, else on the new (empty) node 0.
    ckpt = on(1 if rank < 2 else 0)
    fresh: dict[str, Any] = {"w": torch.zeros(1000), "p": unbroken.Progress(step=0)}
    restored = ckpt.restore(fresh)
    assert ckpt.last_restore is not None
    result = {
        "restored": restored,
        "origins": [o.kind for o in ckpt.last_restore.origins],
        "equal": torch.equal(fresh["w"], torch.full((1000,), float(rank + 3))),
        "progress": fresh["p"].step,
    }
    ckpt.snapshot(4, fresh)
    ckpt.wait()  # step 4 is complete: the survivor frees what nobody needs
    job = os.path.join(root, "node-1", folder_name("j"))
    result["kept"] = sorted(os.listdir(job)) + sorted(os.listdir(os.path.join(job, "replicas")))
    ckpt.close()
    return result


def run_ranks_barrier(root: str, rank: int, world: int) -> None:
    """Wait until every rank has reached this point (files: the group stays as it is)."""
    import time

    open(os.path.join(root, f"at-{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(root, f"at-{r}")) for r in range(world)):
        time.sleep(0.01)


@pytest.mark.timeout(150)
def test_renumbered_ranks_find_their_state_in_any_peers_memory(tmp_path):
    results = run_ranks(_renumbered_job, str(tmp_path), world=4, timeout=140)
    assert [r["restored"] for r in results] == [3, 3, 3, 3]  # not storage: there is none
    assert all(r["equal"] and r["progress"] == 3 for r in results), results
    # Ranks 0 and 1 find what they saved in node 1's replicas of them; ranks 2 and 3
    # get theirs from the folders node 1 kept under their old numbers.
    assert results[0]["origins"] == ["memory", "memory", "replica", "replica"]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    # The survivor holds its own two ranks and replicas of the new node's, nothing else.
    kept = ["owner-00000", "owner-00001", "owner-00002", "owner-00003", "rank-00000",
            "rank-00001", "replicas", "rank-00002", "rank-00003"]  # fmt: skip
    assert results[0]["kept"] == kept, results[0]["kept"]


def test_a_restore_from_memory_copies_the_slot_once_and_backs_up_nothing(tmp_path, backups):
    """The slot, checked on opening, is what stands in for a backup: its bytes are copied
    into the live tensors once every rank has read its part, and no copy of the state is
    taken (an allocation and a copy of it, per rank, on every in-process recovery)."""
    ckpt = _ckpt(tmp_path)
    state = _state()
    train_steps(state["model"], state["optim"], 2)
    ckpt.snapshot(2, state)
    ckpt.wait()
    fresh = _state(seed=9)
    assert _ckpt(tmp_path).restore(fresh) == 2
    assert _equal(_weights(fresh), _weights(state))
    assert (
        fresh["optim"]
        .state_dict()["state"][0]["exp_avg"]
        .equal(state["optim"].state_dict()["state"][0]["exp_avg"])
    )
    assert backups.nbytes == 0
