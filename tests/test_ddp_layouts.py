"""DDP's bucket layouts as the tracker sees them (`unbroken.healing.ddp_buckets`), in real
gloo processes without a launcher: which wrappers count as covering the model, and the
layout DDP is about to rebuild after a wrapper's first backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def test_a_model_wrapped_part_by_part_counts_as_data_parallel_from_when_its_parts_are_built():
    """Parts wrapped after the tracker exists (the usual order: Checkpointer, restore,
    wrap) count from when they are built, so a node lost in the first steps heals live
    (bench/recovery_moments.py lost a step to a kill at step 6 of a model whose experts
    each run every 8th step); the first backward of each part is still watched until it
    ran. Parts wrapped before the tracker count once they ran."""
    from ranks import run_ranks

    after, before = run_ranks(_parts_job, world=1, timeout=60)[0]
    assert after == [True, True, False, True, True]
    assert before == [False, False, False, True, True]


def test_the_layout_ddp_is_about_to_rebuild_is_known_after_its_first_backward():
    from ranks import run_ranks

    found, _ = run_ranks(_pending_job, world=2, timeout=60)
    for name, (pending, rebuilt, initial) in found.items():
        assert pending == rebuilt, name
        assert rebuilt != initial, name  # the case the test is for


def _pending_job(rank: int, world: int) -> dict[str, tuple]:
    """After one iteration the tracker knows the layout DDP rebuilds as the second
    starts: with the default caps (a 1 MiB first bucket before a layer larger than
    it), and with small caps that split the parameters into many buckets."""
    from torch.nn.parallel import DistributedDataParallel

    from unbroken.healing.ddp_buckets import Tracker, layout_now

    found = {}
    for name, cap in (("default", None), ("small buckets", 0.004)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 600), nn.Tanh(), nn.Linear(600, 600), nn.Tanh(),
                              nn.Linear(600, 8), nn.Linear(8, 8))  # fmt: skip
        tracker = Tracker()
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap)
        initial = layout_now(ddp)
        ddp(torch.ones(2, 16)).sum().backward()
        pending = tracker.layouts({"model": model}).get("model")
        ddp(torch.ones(2, 16)).sum().backward()  # DDP rebuilds as this forward starts
        found[name] = (pending, layout_now(ddp), initial)
        tracker.stop()
    return found if rank == 0 else {}


def _parts_job(rank: int, world: int) -> list[list[bool]]:
    """A model whose two parts are each their own DDP, and steps that use one of them
    each, wrapped after the tracker exists and before: per step, whether the tracker
    counts the model as data-parallel (healable), then whether it stopped watching."""
    from torch.nn.parallel import DistributedDataParallel

    from unbroken.healing.ddp_buckets import Tracker

    found = []
    for wrapped_first in (False, True):
        model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        parts = {k: DistributedDataParallel(m) for k, m in model.items()} if wrapped_first else {}
        tracker = Tracker()
        parts = parts or {k: DistributedDataParallel(m) for k, m in model.items()}
        state = {"model": model}
        seen = [tracker.covered(state)]
        parts["a"](torch.ones(1, 4)).sum().backward()
        tracker.settle(state)
        seen += [tracker.covered(state), tracker._handle is None]
        parts["b"](torch.ones(1, 4)).sum().backward()
        tracker.settle(state)  # every part ran: stops watching
        seen += [tracker.covered(state), tracker._handle is None]
        tracker.stop()
        found.append(seen)
    return found


def test_a_stopped_tracker_keeps_its_answer_without_keeping_a_dropped_wrapper_alive():
    """`Tracker.wrappers` runs twice a step; once the tracker stopped it keeps the answer,
    weakly: a wrapper the loop dropped is neither kept alive nor answered."""
    from ranks import run_ranks

    first, kept, walks, after, freed = run_ranks(_kept_job, world=1, timeout=60)[0]
    assert first == kept == ["model:a", "model:b"]
    assert walks == 1  # the second answer was kept, not found again
    assert after == ["model:a"]
    assert freed


def _kept_job(rank: int, world: int) -> list:
    import gc
    import weakref

    from torch.nn.parallel import DistributedDataParallel

    from unbroken.healing.ddp_buckets import Tracker

    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    tracker = Tracker()
    parts = {k: DistributedDataParallel(m) for k, m in model.items()}
    for part in parts.values():
        part(torch.ones(1, 4)).sum().backward()
    del part  # the loop's name held the last wrapper
    state = {"model": model}
    tracker.settle(state)
    assert tracker._handle is None  # stopped: the answer is kept from here on
    walks, walk = [], model.named_modules

    def counted_walk(*args: Any, **kwargs: Any) -> Any:
        walks.append(1)
        return walk(*args, **kwargs)

    model.named_modules = counted_walk  # type: ignore[method-assign]
    first = sorted(tracker.wrappers(state))
    kept = sorted(tracker.wrappers(state))
    counted = len(walks)
    dropped = weakref.ref(parts.pop("b"))
    gc.collect()
    return [first, kept, counted, sorted(tracker.wrappers(state)), dropped() is None]
