"""Aborting a generation of in-process recovery: collectives stuck on a live peer fail at
once instead of at the group's timeout, on both ends, and the Checkpointer's own waits
give up (2 real gloo ranks)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from datetime import timedelta

import pytest

from ranks import run_ranks
from unbroken import abort
from unbroken.errors import CheckpointError

GROUP_TIMEOUT_S = 60  # what the stuck operations would otherwise wait


def _stuck_then_aborted(rank: int, world: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    abort.begin()
    with abort.tracking():
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    started = time.monotonic()
    if rank == 1:
        # Waits for a message rank 0 never sends: only rank 0's abort can end this.
        try:
            dist.recv(torch.empty(4), src=0, group=group)
        except RuntimeError as e:
            return {"raised_after_s": time.monotonic() - started, "error": str(e)}
        return {"raised_after_s": None}
    # Rank 0: the main thread in a collective that rank 1 never joins, a second thread
    # in another; a third aborts after half a second.
    side: dict[str, object] = {}

    def other() -> None:
        try:
            dist.all_gather([torch.empty(1), torch.empty(1)], torch.ones(1), group=group)
        except RuntimeError as e:
            side["raised_after_s"] = time.monotonic() - started
            side["error"] = str(e)

    thread = threading.Thread(target=other)
    thread.start()
    shut: list[int] = []
    timer = threading.Timer(0.5, lambda: shut.append(abort.shutdown()))
    timer.start()
    result: dict[str, object] = {"raised_after_s": None}
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as e:
        result = {"raised_after_s": time.monotonic() - started, "error": str(e)}
    thread.join(GROUP_TIMEOUT_S)
    timer.join()
    with pytest.raises(CheckpointError, match="a peer failed"):
        abort.check("snapshot of step 7")
    return result | {"side": side, "connections": shut[0]}


@pytest.mark.timeout(60)
def test_abort_frees_collectives_stuck_on_a_live_peer_at_both_ends():
    rank0, rank1 = run_ranks(_stuck_then_aborted)
    assert rank0["connections"] >= 1  # the tracked group's connection to rank 1
    for stuck in (rank0, rank0["side"], rank1):
        assert stuck["raised_after_s"] is not None, stuck
        assert 0.4 < stuck["raised_after_s"] < 10, stuck  # at the abort, not the timeout
        assert "closed" in str(stuck["error"]).lower(), stuck


def test_checkpointer_waits_give_up_once_aborted():
    from unbroken.checkpointer import _wait

    never: Future[None] = Future()
    abort.begin()
    try:
        threading.Timer(0.2, abort.shutdown).start()
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="waiting for replication: stopped"):
            _wait([never], "waiting for replication")
        assert time.monotonic() - started < 5
    finally:
        abort.begin()
        abort._enabled = False  # this process is not under in-process recovery
