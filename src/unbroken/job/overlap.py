"""Overlapped capture: the copy of a background save's parameters and optimizer state
runs beside the next forward and backward, instead of before ``save`` returns.

Training changes parameters and optimizer state only inside ``optimizer.step()``. A
process-wide optimizer step pre-hook (`settle`) finishes every pending copy before any
step begins, so each copy holds the values of the step it was taken at. Only the tensors
of optimizers that have stepped in this process are deferred (`deferred`); everything
else in the state (buffers such as BatchNorm's running statistics, which the forward
changes; tensors no optimizer steps) is copied before ``save`` returns, as before.

A loop that changes a deferred tensor some other way (``p.data.clamp_()`` between steps,
``load_state_dict``) would tear the copy, the corruption async saves elsewhere have
shipped (pytorch#144657: tensors mutated during a save; Megatron-LM#1713: NaN after
resuming from an async save). Here it cannot commit: each deferred tensor's version
counter, bumped by every in-place change, is read at the save and again at the settle,
in the training thread, where none of its operations is in flight. A change fails that
save, naming the tensor, and the last committed step stays as it was. Such a loop
passes ``Checkpointer(..., overlap=False)``.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from unbroken.job import abort

_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_pending: list[Copy] = []
_lock = threading.Lock()
_hook: Any = None
# One copier thread per process, kept between saves: starting a thread per save cost the
# training thread a wait for the new thread to be scheduled (about a quarter of what a
# save blocked).
_queue: queue.SimpleQueue[Copy] = queue.SimpleQueue()
_copier: threading.Thread | None = None


def install() -> None:
    """Register the pre-step hook and start the copier, once per process: before
    training starts, so the first background save already knows the optimizers and
    blocks no longer than later ones (`Stager` calls it)."""
    global _hook
    with _lock:
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_pre_step)
    _start()


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _optimizers.add(optimizer)
    settle()


def settle() -> None:
    """Finish every pending copy and judge it: call from the training thread before
    anything may change a deferred tensor (an optimizer step, a restore, a new save)."""
    with _lock:
        pending = _pending[:]
        _pending.clear()
    for copy in pending:
        copy.settle()


def _start() -> None:
    global _copier
    with _lock:
        if _copier is None:  # never ends once started; None in a forked child
            _copier = threading.Thread(target=_serve, name="unbroken-copy", daemon=True)
            _copier.start()


def _enqueue(copy: Copy) -> None:
    _start()  # after a fork, the child's first
    _queue.put(copy)


def _serve() -> None:
    while True:
        _queue.get()._copy()


def _forked() -> None:
    """A forked child has none of the parent's threads: it starts its own copier, and the
    parent's copies under way are not its to wait for."""
    global _copier, _queue, _lock
    # A lock a parent's thread held at the fork would stay held here for good.
    _copier, _queue, _lock = None, queue.SimpleQueue(), threading.Lock()
    _pending.clear()


os.register_at_fork(after_in_child=_forked)


def deferred(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Which of ``tensors`` only an optimizer step changes, so that their copy may wait
    for the next one: those sharing storage with the parameters or state of an optimizer
    that has stepped in this process, in-place changes to them counted (not inference
    tensors), and not empty."""
    stepped: set[int] = set()
    for optimizer in list(_optimizers):
        for group in optimizer.param_groups:
            stepped.update(_storage(p) for p in group["params"])
        for state in list(optimizer.state.values()):
            stepped.update(_storage(v) for v in state.values() if torch.is_tensor(v))
    return [t.numel() > 0 and not t.is_inference() and _storage(t) in stepped for t in tensors]


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s bytes live; a DTensor's (FSDP2's parameters and their optimizer state)
    are its local shard's, as a DTensor itself has no storage to ask."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr()


class Copy:
    """The deferred part of one save's staging: ``sources`` (live tensors, named by
    ``keys``) into their copies. The copier thread copies the CPU ones (``pairs``: copy,
    source) now, in the order the saves came; the CUDA ones are already queued on a side
    stream, landed when ``landed`` completes."""

    def __init__(
        self,
        keys: Sequence[str],
        sources: Sequence[torch.Tensor],
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        landed: torch.cuda.Event | None,
    ) -> None:
        self.keys, self.sources, self.landed = list(keys), list(sources), landed
        self.versions = [t._version for t in sources]
        self.error: str | None = None
        self.settled = threading.Event()
        # CUDA sources copied by the thread (snapshots): only once the kernels queued so
        # far on the training thread's streams, the last optimizer step's among them, ran.
        queued = []
        for device in {src.device for _, src in pairs if src.is_cuda}:
            queued.append(torch.cuda.Event())
            queued[-1].record(torch.cuda.current_stream(device))
        self._pairs, self._queued = list(pairs), queued
        self._copied = threading.Event()
        with _lock:
            _pending.append(self)
        _enqueue(self)

    def _copy(self) -> None:
        """On the copier thread."""
        try:
            for event in self._queued:
                event.synchronize()
            with torch.no_grad():
                for dst, src in self._pairs:
                    dst.copy_(src)
        except Exception as e:  # judged at the settle, with the rest
            self.error = f"the background copy failed: {e}"
        finally:
            self._pairs, self._queued = [], []
            self._copied.set()

    def settle(self) -> None:
        """Wait for the CPU copies, make later CUDA work wait for the others, and check
        that no deferred tensor changed since the save (training thread only)."""
        if self.settled.is_set():
            return
        try:
            self._copied.wait()
            if self.landed is not None:  # later kernels wait for the copies; this thread not
                device = next(t.device for t in self.sources if t.is_cuda)
                torch.cuda.current_stream(device).wait_event(self.landed)
            changed = [
                k for k, t, v in zip(self.keys, self.sources, self.versions, strict=True)
                if t._version != v
            ]  # fmt: skip
            if changed and self.error is None:
                self.error = (
                    f"tensor(s) {', '.join(changed[:5])} changed outside optimizer.step() "
                    "while their background copy ran: this save is dropped and the last "
                    "committed step stays. A loop that changes parameters or optimizer "
                    "state between steps needs Checkpointer(..., overlap=False)"
                )
        except Exception as e:  # never raised here: the save fails, the other copies settle
            self.error = self.error or f"settling the background copy failed: {e}"
        finally:
            self.settled.set()

    def copied(self, what: str) -> None:
        """Wait (in the save thread) until the copier thread has copied the CPU sources:
        the copies may be read (hashed, written) from then on, but only `verdict` says
        whether they hold the step's values."""
        _wait(self._copied, what)

    def verdict(self, what: str) -> str | None:
        """Wait (in the save thread) until the training thread settled this copy: its
        error, or None once every copy has landed intact."""
        _wait(self.settled, what)
        if self.landed is not None:
            self.landed.synchronize()
        return self.error


def _wait(event: threading.Event, what: str) -> None:
    while not event.wait(abort.poll_s()):
        abort.check(what)
