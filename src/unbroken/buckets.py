"""DDP's gradient bucket layout, carried across restarts so that training stays bitwise.

A new `DistributedDataParallel` wrapper reduces its first iteration's gradients in an
initial bucket layout (parameters in reverse definition order), then rebuilds the buckets
in the order the gradients became ready and keeps that layout. Where a bucket's elements
sit in its flat buffer decides the order in which gloo (and NCCL) sum the ranks'
contributions, so at 3 or more ranks the first iteration after a restart (or after an
in-process generation builds a new wrapper) differs from an uninterrupted run's by an
ulp, and the runs drift apart from there. ``find_unused_parameters=True`` hides it (no
rebuild), at the cost of a graph traversal per iteration.

unbroken instead records the rebuilt layout (`layout`, in the per-step record and the
restore outcome), and gives a new wrapper that layout before its first iteration
(`apply`): its reducer is rebuilt by DDP's own construction code with those buckets.
The reducer then rebuilds once more after that iteration, from the gradients' ready
order, which is the same order again: nothing changes. Wrappers built with
``static_graph=True`` or ``find_unused_parameters=True`` are left as they are (the first
has no rebuild to match for; the second never rebuilds).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("unbroken")

Layout = list[list[int]]  # reducer parameter indices, bucket by bucket


def wrappers(state: Mapping[str, Any]) -> dict[str, DistributedDataParallel]:
    """The DDP wrappers among the top-level entries of ``state``, by name."""
    return {k: v for k, v in state.items() if isinstance(v, DistributedDataParallel)}


def _eligible(ddp: DistributedDataParallel) -> bool:
    reducer = getattr(ddp, "reducer", None)
    return (
        reducer is not None
        and not ddp.static_graph
        and not ddp.find_unused_parameters
        and not getattr(ddp, "_use_python_reducer", False)
        and not getattr(ddp, "_delay_all_reduce_all_params", False)
    )


def layout(ddp: DistributedDataParallel) -> Layout | None:
    """The wrapper's bucket layout once its buckets are rebuilt, else None."""
    if not _eligible(ddp) or not ddp._get_ddp_logging_data().get("has_rebuilt_buckets"):
        return None
    params, _ = ddp._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    found = []
    for bucket in ddp.reducer._get_zeros_like_grad_buckets():
        ids = [index.get(id(p)) for p in bucket.parameters()]
        if None in ids:
            return None
        found.append([int(i) for i in ids if i is not None])
    return found


def apply(ddp: DistributedDataParallel, wanted: Layout) -> bool:
    """Give ``ddp`` the bucket layout ``wanted`` if it has not run an iteration yet and
    the layout fits its parameters. Collective on the wrapper's group (DDP checks the
    layout agrees across ranks). Whether it was applied."""
    if not _eligible(ddp) or ddp._get_ddp_logging_data().get("num_iterations", 0):
        return False
    params, expect_sparse = ddp._build_params_for_reducer()
    flat = sorted(i for bucket in wanted for i in bucket)
    if flat != list(range(len(params))) or layout_now(ddp) == wanted:
        return False
    ddp.reducer._remove_autograd_hooks()
    with _assignment(wanted):
        ddp._ddp_init_helper(
            params, expect_sparse, ddp._build_debug_param_to_name_mapping(params), False
        )
    log.info("DDP buckets laid out as before the restore: %d buckets", len(wanted))
    return True


def layout_now(ddp: DistributedDataParallel) -> Layout:
    """The wrapper's current bucket layout, rebuilt or not."""
    params, _ = ddp._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


@contextmanager
def _assignment(wanted: Layout) -> Iterator[None]:
    """Make DDP's construction code assign ``wanted`` (it reverses what it is given)."""
    original = dist._compute_bucket_assignment_by_size

    def assign(params: Any, limits: Any, *args: Any, **kwargs: Any) -> Any:
        _, sizes = original(params, limits, *args, **kwargs)
        cap = max(sizes) if sizes else 0
        return list(reversed(wanted)), [cap] * len(wanted)

    dist._compute_bucket_assignment_by_size = assign  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = original  # type: ignore[attr-defined]
