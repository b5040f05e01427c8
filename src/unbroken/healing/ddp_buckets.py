"""DDP's gradient bucket layout, carried across restarts so that training stays bitwise.

A new `DistributedDataParallel` wrapper reduces its first iteration's gradients in an
initial bucket layout (parameters in reverse definition order), then rebuilds the buckets
in the order the gradients became ready and keeps that layout. Where a bucket's elements
sit in its flat buffer decides the order in which gloo (and NCCL) sum the ranks'
contributions, so at 3 or more ranks the first iteration after a restart (or after an
in-process generation builds a new wrapper) differs from an uninterrupted run's by an
ulp, and the runs drift apart from there. ``find_unused_parameters=True`` hides it (no
rebuild), at the cost of a graph traversal per iteration.

unbroken instead records the rebuilt layout (`layout`, in the per-step record, the
node's shared memory and each saved step's info file, which is all a restore from
storage has), and gives a new wrapper that layout before its first iteration
(`apply`): its reducer is rebuilt by DDP's own construction code with those buckets.
The reducer then rebuilds once more after that iteration, from the gradients' ready
order, which is the same order again: nothing changes. Wrappers built with
``static_graph=True`` or ``find_unused_parameters=True`` are left as they are (the first
has no rebuild to match for; the second never rebuilds).

A wrapper lost after its first iteration and before its second has run no rebuild yet,
but its next iteration would have: it is owed the layout DDP was about to build. The
tracker watches each wrapper's first backward for the order its gradients become ready
(`Ready`) and computes that layout as DDP's reducer does (`pending`).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

log = logging.getLogger("unbroken")

Layout = list[list[int]]  # reducer parameter indices, bucket by bucket
Wrapper = weakref.ref[DistributedDataParallel]
WATCH_STEPS = 64  # steps to watch for wrappers of parts of a model that a step may skip


class Tracker:
    """Finds the DDP wrappers of a state's modules, including wrappers built after
    `restore` (the usual order: restore, then wrap), and gives each the layout it is
    owed before its first iteration.

    Until `settle` sees every module of the state wrapped (a whole model after one
    iteration; one wrapped part by part once each part has run) a global forward pre-hook
    watches every module call for a DDP wrapper's."""

    def __init__(self) -> None:
        self._seen: list[weakref.ref[DistributedDataParallel]] = []
        self._owed: dict[int, Layout] = {}  # id of a wrapped module -> layout
        self._known: weakref.WeakKeyDictionary[DistributedDataParallel, Layout] = (
            weakref.WeakKeyDictionary()
        )
        self._ready: weakref.WeakKeyDictionary[DistributedDataParallel, Ready] = (
            weakref.WeakKeyDictionary()
        )
        self._settles = 0
        self._covered: tuple[tuple[int, ...], bool] | None = None  # see `covered`
        # Asked twice a step: once stopped, the wrappers of the same module entries are
        # kept (weakly: a wrapper the loop dropped is looked for again).
        self._wrappers: tuple[tuple[Any, ...], dict[str, Wrapper]] | None = None
        self._handle: RemovableHandle | None = nn.modules.module.register_module_forward_pre_hook(
            self._hook
        )
        # Wrappers built while this tracker watches, run or not (`covered`).
        self._built: list[weakref.ref[DistributedDataParallel]] = []
        self._building: RemovableHandle | None = (
            nn.modules.module.register_module_module_registration_hook(self._registered)
        )

    def _registered(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        if isinstance(parent, DistributedDataParallel) and name == "module":
            self._built.append(weakref.ref(parent))

    def _hook(self, module: nn.Module, args: Any) -> None:
        if not isinstance(module, DistributedDataParallel):
            return
        if all(ref() is not module for ref in self._seen):
            self._seen.append(weakref.ref(module))
        owed = self._owed.pop(id(module.module), None)
        if owed is not None:
            apply(module, owed)
        ready = self._ready.get(module)
        if ready is not None:
            if not ready.complete():
                ready.close()  # a backward that did not reach every parameter: no layout
        elif _first_synced(module):
            self._ready[module] = Ready(module)

    def owe(self, state: Mapping[str, Any], layouts: Mapping[str, Layout]) -> None:
        """Apply ``layouts`` (by `key`) to the wrappers in ``state`` now, and to wrappers
        of its modules built later, at their first forward."""
        for key, wanted in layouts.items():
            value = resolve(state, key)
            if isinstance(value, DistributedDataParallel):
                apply(value, wanted)
            elif value is not None and self._handle is not None:
                self._owed[id(value)] = wanted

    def wrappers(self, state: Mapping[str, Any]) -> dict[str, DistributedDataParallel]:
        """The DDP wrappers of ``state``'s modules, by `key`: of an entry (or an entry
        that is one), or of a part of an entry's module (a model wrapped part by part)."""
        asked = tuple((name, id(v)) for name, v in state.items() if isinstance(v, nn.Module))
        if self._wrappers is not None and self._wrappers[0] == asked:
            kept = {name: w for name, ref in self._wrappers[1].items() if (w := ref()) is not None}
            if len(kept) == len(self._wrappers[1]):
                return kept
        seen = [w for w in (ref() for ref in self._seen) if w is not None]
        found = {}
        for name, value in state.items():
            if isinstance(value, DistributedDataParallel):
                found[name] = value
            elif isinstance(value, nn.Module) and seen:
                paths = {id(m): path for path, m in value.named_modules()}
                for w in seen:
                    if (path := paths.get(id(w.module))) is not None:
                        found[key(name, path)] = w
        if self._handle is None:  # stopped: no wrapper is seen any more, as in `covered`
            self._wrappers = asked, {name: weakref.ref(w) for name, w in found.items()}
        return found

    def layouts(self, state: Mapping[str, Any]) -> dict[str, Layout]:
        """The rebuilt layouts of ``state``'s wrappers (each read once: it never changes
        after the rebuild, and reading it allocates a copy of the buckets)."""
        found = {}
        for name, wrapper in self.wrappers(state).items():
            known = self._known.get(wrapper)
            if known is None:
                known = layout(wrapper)
                ready = self._ready.get(wrapper)
                if known is None and ready is not None and ready.complete():
                    known = pending(wrapper, ready.order)
                if known is not None:
                    self._known[wrapper] = known
            if known is not None:
                found[name] = known
        return found

    def covered(self, state: Mapping[str, Any]) -> bool:
        """Whether every parameter of ``state``'s modules is in a DDP wrapper: one seen
        running, or built while this tracker watched (DDP gives a wrapper's parameters the
        same values on every rank as it builds it). A model whose parts each run every
        few steps is covered from its first step, not once every part ran."""
        # Asked every step: once no new wrapper can be seen, the answer for the same
        # modules and wrappers is kept.
        wrappers = self._alive(self._seen + self._built)
        modules = [v for v in state.values() if isinstance(v, nn.Module)]
        asked = (*map(id, modules), *map(id, wrappers))
        if self._covered is not None and self._covered[0] == asked:
            return self._covered[1]
        answer = _covers(modules, wrappers)
        if self._handle is None:
            self._covered = asked, answer
        return answer

    def settle(self, state: Mapping[str, Any]) -> None:
        """Stop watching once no layout is owed and every module of ``state`` is seen
        wrapped and run (parts used only every few steps take a few steps: the first
        backward of each is watched, see `Ready`), or after `WATCH_STEPS` calls."""
        if self._handle is None:  # stopped: nothing more to see (called every step)
            return
        self._settles += 1
        modules = [v for v in state.values() if isinstance(v, nn.Module)]
        if not self._owed and (
            _covers(modules, self._alive(self._seen)) or self._settles >= WATCH_STEPS
        ):
            self.stop()

    @staticmethod
    def _alive(refs: list[weakref.ref[DistributedDataParallel]]) -> list[DistributedDataParallel]:
        return list({id(w): w for w in (ref() for ref in refs) if w is not None}.values())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._owed.clear()
        if self._building is not None:
            self._building.remove()
            self._building = None
        for ready in self._ready.values():
            ready.close()


class Ready:
    """The order in which a wrapper's parameters get their gradients in its first
    backward (reducer indices): what DDP rebuilds its buckets from."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        params, _ = ddp._build_params_for_reducer()
        self.order: list[int] = []
        self._count = len(params)
        self._handles = [
            p.register_post_accumulate_grad_hook(lambda _, i=i: self._seen(i))
            for i, p in enumerate(params)
        ]

    def _seen(self, index: int) -> None:
        self.order.append(index)
        if self.complete():
            self.close()

    def complete(self) -> bool:
        return len(self.order) == self._count

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def check_layouts(raw: Any, state: Mapping[str, Any]) -> dict[str, Layout]:
    """``raw`` (parsed JSON: a shared-memory file, a peer's record or proposal) as layouts
    by state entry. ValueError unless it is an object whose every entry names a module of
    ``state`` (or its DDP wrapper) and whose layout lists, in non-empty buckets, each index
    of at most that module's trainable parameters once. Flat checks only: nothing
    recurses into it. `apply` checks the exact fit again against the wrapper."""
    if not isinstance(raw, dict):
        raise ValueError("the layouts are not an object")
    found = {}
    for name, wanted in raw.items():
        value = resolve(state, name) if isinstance(name, str) else None
        module = value.module if isinstance(value, DistributedDataParallel) else value
        if not isinstance(module, nn.Module):
            raise ValueError(f"{name!r:.60} is not a module of the state")
        if not (
            isinstance(wanted, list)
            and all(isinstance(b, list) and b and all(type(i) is int for i in b) for b in wanted)
        ):
            raise ValueError(f"the layout of {name!r} is not buckets of parameter indices")
        count = sum(1 for p in module.parameters() if p.requires_grad)
        indices = sorted(i for b in wanted for i in b)
        if len(indices) > count or indices != list(range(len(indices))):
            raise ValueError(f"the layout of {name!r} does not fit its {count} parameters")
        found[name] = [list(b) for b in wanted]
    return found


def key(entry: str, path: str) -> str:
    """A layout's key: the state entry, or ``entry:path`` for the wrapper of a part of its
    module (``path`` as `nn.Module.get_submodule` takes it)."""
    return f"{entry}:{path}" if path else entry


def resolve(state: Mapping[str, Any], name: str) -> nn.Module | None:
    """The module a layout's `key` names in ``state``, or None."""
    value = state.get(name)
    if value is None and ":" in name:
        entry, path = name.rsplit(":", 1)
        top = state.get(entry)
        top = top.module if isinstance(top, DistributedDataParallel) else top
        if isinstance(top, nn.Module):
            try:
                value = top.get_submodule(path)
            except AttributeError:
                return None
    return value if isinstance(value, nn.Module) else None


def _eligible(ddp: DistributedDataParallel) -> bool:
    reducer = getattr(ddp, "reducer", None)
    return (
        reducer is not None
        and not ddp.static_graph
        and not ddp.find_unused_parameters
        and not getattr(ddp, "_use_python_reducer", False)
        and not getattr(ddp, "_delay_all_reduce_all_params", False)
    )


def _first_synced(ddp: DistributedDataParallel) -> bool:
    """Whether this forward's backward is the one DDP rebuilds its buckets from."""
    synced = torch.is_grad_enabled() and ddp.require_backward_grad_sync
    return synced and _eligible(ddp) and not _rebuilt(ddp)


def _rebuilt(ddp: DistributedDataParallel) -> bool:
    return bool(ddp._get_ddp_logging_data().get("has_rebuilt_buckets"))


def _covers(modules: list[nn.Module], wrappers: list[DistributedDataParallel]) -> bool:
    wrapped = {id(p) for w in wrappers for p in w.module.parameters()}
    return bool(modules) and all(
        isinstance(m, DistributedDataParallel) or all(id(p) in wrapped for p in m.parameters())
        for m in modules
    )


def layout(ddp: DistributedDataParallel) -> Layout | None:
    """The wrapper's bucket layout once its buckets are rebuilt, else None."""
    if not _eligible(ddp) or not _rebuilt(ddp):
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


def pending(ddp: DistributedDataParallel, order: list[int]) -> Layout | None:
    """The layout ``ddp``'s reducer rebuilds from gradients ready in ``order``, assigned
    by DDP's own function with the reducer's size limits; None where DDP is told to
    assign in reverse (``DDP_SET_LAST_BUCKET_CAP``)."""
    if os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1":
        return None
    params, expect_sparse = ddp._build_params_for_reducer()
    config = getattr(ddp, "_bucket_config", None)
    limits: list[int] = []
    if config is not None:  # torch >= 2.10: per-bucket limits where the user set them
        _, limits = config.compute_bucket_size_limits(
            static_graph=False, find_unused_parameters=False
        )
        first = config.first_bucket_bytes_cap
    else:
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if ddp.bucket_bytes_cap_default else None
    limits = limits or [first or ddp.bucket_bytes_cap, ddp.bucket_bytes_cap]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, expect_sparse, order
    )
    return [[int(i) for i in bucket] for bucket in buckets]


def apply(ddp: DistributedDataParallel, wanted: Layout) -> bool:
    """Give ``ddp`` the bucket layout ``wanted`` if it has not run an iteration yet and
    the layout fits its parameters. Collective on the wrapper's group (DDP checks the
    layout agrees across ranks). Whether it was applied."""
    if not _eligible(ddp) or ddp._get_ddp_logging_data().get("num_iterations", 0):
        return False
    params, expect_sparse = ddp._build_params_for_reducer()
    if not (
        isinstance(wanted, list)
        and all(isinstance(b, list) and all(type(i) is int for i in b) for b in wanted)
        and sorted(i for b in wanted for i in b) == list(range(len(params)))
    ):
        log.warning("ignoring a recorded DDP bucket layout that does not fit the model")
        return False
    if layout_now(ddp) == wanted:
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
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in b.parameters()] for b in buckets]


@contextmanager
def _assignment(wanted: Layout) -> Iterator[None]:
    """Make DDP's construction code assign ``wanted`` (it reverses what it is given)."""
    original = dist._compute_bucket_assignment_by_size

    def assign(params: Any, limits: Any, *args: Any, **kwargs: Any) -> Any:
        _, sizes = original(params, limits, *args, **kwargs)
        cap = max(sizes) if sizes else 0
        return list(reversed(wanted)), [cap] * len(wanted)

    dist._compute_bucket_assignment_by_size = assign  # type: ignore[assignment]
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = original
