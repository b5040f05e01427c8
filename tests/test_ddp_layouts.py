"""DDP's bucket layouts as the tracker sees them (`unbroken.healing.ddp_buckets`), in real
gloo processes without a launcher: which wrappers count as covering the model, and the
layout DDP is about to rebuild after a wrapper's first backward."""

from __future__ import annotations

import torch
from torch import nn


def test_a_model_wrapped_part_by_part_counts_as_data_parallel_once_every_part_ran():
    from ranks import run_ranks

    assert run_ranks(_parts_job, world=1, timeout=60) == [[False, False, True, True]]


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


def _parts_job(rank: int, world: int) -> list[bool]:
    """A model whose two parts are each their own DDP, and a step that uses only one of
    them: the tracker counts the model as data-parallel (healable) only once both ran."""
    from torch.nn.parallel import DistributedDataParallel

    from unbroken.healing.ddp_buckets import Tracker

    tracker = Tracker()
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    state = {"model": model}
    parts = {k: DistributedDataParallel(m) for k, m in model.items()}
    seen = [tracker.covered(state)]
    parts["a"](torch.ones(1, 4)).sum().backward()
    tracker.settle(state)
    seen.append(tracker.covered(state))
    parts["b"](torch.ones(1, 4)).sum().backward()
    tracker.settle(state)  # every part seen: stops watching
    seen += [tracker.covered(state), tracker._handle is None]
    return seen
