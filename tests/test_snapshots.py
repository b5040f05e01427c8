"""Snapshots cheap enough for every step: copied on the caller's thread, checksummed,
published and replicated in the background, never visible before they are whole."""

import os
import threading
import time
from typing import Any

import pytest
import torch

from ranks import run_ranks
from unbroken import Checkpointer, CheckpointError
from unbroken.format.layout import Manifest
from unbroken.memory.snapshots import blocks_of, copy, seal
from unbroken.memory.tier import OWN_SLOTS


def _ckpt(root, **kwargs: Any) -> Checkpointer:
    return Checkpointer(
        os.path.join(root, "ckpt"), memory=True, memory_dir=os.path.join(root, "shm"),
        job="snap", **kwargs,
    )  # fmt: skip


def test_a_slots_manifest_is_read_again_only_once_the_slot_changed(tmp_path, monkeypatch):
    """`Slots.steps` (asked for every copy at every snapshot) parses a slot's manifest
    once, and again only after the slot was rewritten or lost."""
    from unbroken.memory.tier import Slots

    ckpt, state = _ckpt(str(tmp_path)), {"w": torch.full((1000,), 1.0)}
    for step in (1, 2):
        ckpt.snapshot(step, state)
        ckpt.wait()
    loads: list[int] = []
    real = Slots._load

    def load(self: Slots, slot: int) -> Any:
        loads.append(slot)
        return real(self, slot)

    monkeypatch.setattr(Slots, "_load", load)
    assert ckpt._memory is not None
    own = ckpt._memory.own
    assert own.steps() == {1, 2} and own.steps() == {1, 2} and len(loads) <= OWN_SLOTS
    asked = len(loads)
    ckpt.snapshot(3, state)  # a slot rewritten
    ckpt.wait()
    assert 3 in own.steps() and len(loads) == asked + 1
    slot, _ = own.whole()[3]
    os.unlink(own._path(slot, "json"))
    assert 3 not in own.steps()


def test_a_replicas_manifest_is_checked_before_it_is_published(tmp_path):
    """A snapshot's own manifest is published as built (`seal`); one a peer sent for its
    replica is parsed and checked first: a chunk past the slot's bytes never counts."""
    ckpt, state = _ckpt(str(tmp_path)), {"w": torch.full((1000,), 1.0)}
    ckpt.snapshot(1, state)
    ckpt.wait()
    assert ckpt._memory is not None
    _, manifest = ckpt._memory.own.whole()[1]
    text = manifest.to_json().decode()
    slots = ckpt._memory.replica(1)
    slot, _ = slots.begin(sum(manifest.files.values()))
    with pytest.raises(CheckpointError, match="w"):
        slots.publish(slot, text.replace('"end":4000', '"end":40000'))
    assert slots.whole() == {}
    slots.publish(slot, text)
    assert list(slots.whole()) == [1]


def test_a_copy_is_invisible_until_sealed_and_never_overwrites_the_newest(tmp_path):
    ckpt = _ckpt(str(tmp_path))
    state = {"w": torch.full((1000,), 1.0)}
    ckpt.snapshot(1, state)
    ckpt.wait()
    memory = ckpt._memory
    assert memory is not None and OWN_SLOTS == 3
    newest = memory.own.newest
    state["w"].fill_(2.0)
    blocks, tree = blocks_of(state)
    second = copy(memory, 2, blocks)  # copied, not yet checksummed nor published
    third = copy(memory, 3, blocks)  # while the second is in flight: the third slot
    assert len({newest, second.slot, third.slot}) == 3
    with pytest.raises(CheckpointError, match="every slot is in use"):
        memory.own.begin(8)
    fresh = {"w": torch.zeros(1000)}
    assert _ckpt(str(tmp_path)).restore(fresh) == 1  # neither copy counts yet
    assert torch.equal(fresh["w"], torch.full((1000,), 1.0))
    seal(memory, second, tree)
    memory.own.release(second.slot)
    assert _ckpt(str(tmp_path)).restore(fresh) == 2
    assert torch.equal(fresh["w"], torch.full((1000,), 2.0))
    memory.own.release(third.slot)
    ckpt.close()


def test_every_step_snapshots_stay_whole(tmp_path):
    ckpt = _ckpt(str(tmp_path))
    state = {"w": torch.zeros(1 << 16)}
    for step in range(1, 21):  # no wait between them: several are in flight at once
        state["w"].fill_(float(step))
        ckpt.snapshot(step, state)
    ckpt.wait()
    fresh = {"w": torch.zeros(1 << 16)}
    assert _ckpt(str(tmp_path)).restore(fresh) == 20
    assert torch.equal(fresh["w"], torch.full((1 << 16,), 20.0))
    ckpt.close()


def _unblocked_job(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["UNBROKEN_NODE"] = str(rank)  # two simulated nodes: replicas cross them
    shm = os.path.join(root, f"node-{rank}")
    ckpt = Checkpointer(
        os.path.join(root, "ckpt"), memory=True, replicas=1, memory_dir=shm, job="j"
    )
    state = {"w": torch.full((1000,), float(rank))}
    gate = threading.Event()
    ckpt._worker.submit(gate.wait, 60)  # the save worker is busy: replications queue up
    ckpt.snapshot(1, state)
    state["w"] += 1
    started = time.perf_counter()
    ckpt.snapshot(2, state)  # would hang until the gate opens if it waited for step 1's
    returned = time.perf_counter() - started
    replicated_early = ckpt._replicating is not None and ckpt._replicating.done()
    gate.set()
    ckpt.wait()
    fresh = {"w": torch.zeros(1000)}
    restored = ckpt.restore(fresh)
    ckpt.close()
    return {
        "returned_s": returned,
        "replicated_early": replicated_early,
        "restored": restored,
        "equal": torch.equal(fresh["w"], torch.full((1000,), float(rank + 1))),
    }


@pytest.mark.timeout(90)
def test_a_snapshot_never_waits_for_the_replication_of_the_one_before(tmp_path):
    results = run_ranks(_unblocked_job, str(tmp_path), timeout=80)
    assert all(r["returned_s"] < 10 and not r["replicated_early"] for r in results), results
    assert all(r["restored"] == 2 and r["equal"] for r in results), results


def _kept_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """Step 1 is replicated; step 2's replication is held up (the save worker is busy,
    as when a node dies in the middle of it) and step 3 comes: which steps does each
    rank then hold of itself, and of its peer?"""
    os.environ["UNBROKEN_NODE"] = str(rank)  # two simulated nodes: replicas cross them
    ckpt = Checkpointer(
        os.path.join(root, "ckpt"), memory=True, replicas=1,
        memory_dir=os.path.join(root, f"node-{rank}"), job="j",
    )  # fmt: skip
    state = {"w": torch.full((1000,), float(rank))}
    ckpt.snapshot(1, state)
    ckpt.wait()
    gate = threading.Event()
    ckpt._worker.submit(gate.wait, 60)
    ckpt.snapshot(2, state)
    memory = ckpt._memory
    assert memory is not None
    deadline = time.monotonic() + 30
    while 2 not in memory.own.whole() and time.monotonic() < deadline:
        time.sleep(0.01)  # sealed: now the newest, and still waiting to be sent
    ckpt.snapshot(3, state)
    while 3 not in memory.own.whole() and time.monotonic() < deadline:
        time.sleep(0.01)
    held = {"own": sorted(memory.own.whole()), "peer": memory.steps_of().get(1 - rank, [])}
    gate.set()
    ckpt.wait()
    ckpt.close()
    return held


@pytest.mark.timeout(90)
def test_the_newest_step_the_peers_hold_is_kept_while_the_next_is_sent(tmp_path):
    """Were a node lost now, its ranks could only come back to step 1 (their peers hold
    nothing newer of them): the others must still hold step 1 of their own, or no step
    would be common to every rank and all would go back to storage."""
    results = run_ranks(_kept_job, str(tmp_path), timeout=80)
    for held in results:
        assert held["own"] == [1, 2, 3] and held["peer"] == [1], results


def test_a_crash_after_a_snapshot_returned_finds_the_step_before_whole(tmp_path, monkeypatch):
    """Step 1's checksum is slow (a loaded machine): snapshot 2 returns only once step 1
    is published, so a process killed after it comes back from step 1 or 2, not older."""
    gate = threading.Event()

    def slow_seal(memory, copied, tree) -> None:
        if copied.step == 1:
            gate.wait(60)
        seal(memory, copied, tree)

    monkeypatch.setattr("unbroken.memory.snapshots.seal", slow_seal)
    ckpt = _ckpt(str(tmp_path))
    state = {"w": torch.ones(1000)}
    ckpt.snapshot(1, state)
    second = threading.Thread(target=ckpt.snapshot, args=(2, state))
    second.start()
    second.join(0.5)
    memory = ckpt._memory
    assert memory is not None
    assert second.is_alive() and memory.own.whole() == {}  # waiting for step 1, unpublished
    gate.set()
    second.join(30)
    assert not second.is_alive() and 1 in memory.own.whole()
    ckpt.wait()
    assert sorted(memory.own.whole()) == [1, 2]
    ckpt.close()


def test_a_failure_the_snapshot_waited_for_is_raised_before_a_slot_is_overwritten(
    tmp_path, monkeypatch
):
    """Step 2's publishing fails while snapshot 3 waits for it (as a replication fails
    when a peer dies): snapshot 3 raises it and copies nothing. Overwriting a slot then
    could destroy the only step some rank still holds (test_examples' DDP kill)."""
    gate = threading.Event()

    def failing_seal(memory, copied, tree) -> None:
        if copied.step == 2:
            gate.wait(60)
            raise OSError("the disk under the slot went away")
        seal(memory, copied, tree)

    monkeypatch.setattr("unbroken.memory.snapshots.seal", failing_seal)
    ckpt = _ckpt(str(tmp_path))
    state = {"w": torch.ones(1000)}
    ckpt.snapshot(1, state)
    ckpt.snapshot(2, state)
    memory = ckpt._memory
    assert memory is not None
    copied: list[int] = []
    begin = memory.own.begin

    def counted(nbytes: int) -> tuple[int, torch.Tensor]:
        copied.append(nbytes)
        return begin(nbytes)

    monkeypatch.setattr(memory.own, "begin", counted)
    errors: list[BaseException] = []

    def third() -> None:
        try:
            ckpt.snapshot(3, state)
        except CheckpointError as e:
            errors.append(e)

    waiting = threading.Thread(target=third)
    waiting.start()
    waiting.join(0.3)  # inside snapshot 3, waiting for step 2
    gate.set()
    waiting.join(30)
    assert [str(e) for e in errors] == [
        "the snapshot of step 2 failed: the disk under the slot went away"
    ]
    assert copied == [] and sorted(memory.own.whole()) == [1]
    ckpt.close()


@pytest.mark.parametrize("fresh_process", [False, True])
def test_a_slot_being_overwritten_is_never_sent_and_the_others_still_are(tmp_path, fresh_process):
    """A replication reads the slot of its step while the next snapshot takes another
    (`begin` unlinks that one's description). What it sends is never the slot being
    overwritten, and a description gone meanwhile does not fail the others: a restarted
    rank, which knows its slots only from their files, sent nothing once (CI, 4ceff6e)."""
    ckpt = _ckpt(str(tmp_path))
    state = {"w": torch.zeros(1000)}
    for step in (1, 2, 3):
        state["w"].fill_(float(step))
        ckpt.snapshot(step, state)
        ckpt.wait()
    ckpt.close()
    memory = (_ckpt(str(tmp_path)) if fresh_process else ckpt)._memory
    assert memory is not None
    held = {slot: step for step, (slot, _) in memory.own.whole().items()}
    slot, _ = memory.own.begin(4000)  # not the newest: step 1's or 2's
    assert held.get(slot) in (1, 2) and slot not in {s for s, _ in memory.own.whole().values()}
    with pytest.raises(CheckpointError, match=f"holds no snapshot of step {held[slot]}"):
        memory.own.raw(held[slot])
    text, data = memory.own.raw(3)
    assert Manifest.from_json(text.encode(), "slot", whole=False).step == 3
    assert torch.equal(data[:4000].view(torch.float32), torch.full((1000,), 3.0))
    memory.own.release(slot)
