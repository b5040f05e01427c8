"""Point-to-point transfers on the checkpointer's gloo group, and tensors lent to gloo.

No gloo thread ever runs Python for the checkpointer's operations (`lent`). One that
drops a tensor's second reference must take the GIL, and creates a Python thread state
to do so: a fork at that instant (a DataLoader starting its workers, right after a
restore or beside a background save) copies CPython's lock on the thread list held, and
the child hangs before it runs a line (CPython before 3.11.10: gh-112275). Right after a
collective returned, gloo still held one of its tensors about a third of the time
(measured, 2 ranks on 2 cores); the demo's resumed run hung about once in 20.

Under in-process recovery a transfer, or a collective (`done`), is waited for in bounded
waits (`abort.waited`): gloo's ``Work.wait`` cannot be given a timeout for a send or
receive (a timed-out receive breaks its pair), and a receive on a connection the abort
could not see (one still being made as the generation was aborted) is otherwise woken
only by the group's timeout, a minute, while the rest of the job waits for this rank in
the next generation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from unbroken.job import abort

_LET_GO_S = 1.0  # gloo lets go microseconds after an operation ends; past this, give up


def done(work: dist.Work | None, what: str = "a collective of the checkpointer's group") -> None:
    """Wait for a collective started with ``async_op=True``: bounded under in-process
    recovery as `Transfers.wait` is (gloo's collectives connect lazily too)."""
    assert work is not None
    abort.waited(what, work.wait)


class Transfers:
    """Point-to-point transfers under way; `wait` returns once all are done and gloo has
    let go of their tensors."""

    def __init__(self, ops: Sequence[dist.P2POp]) -> None:
        self._kept = _Kept([op.tensor for op in ops])
        self._works = list(dist.batch_isend_irecv(list(ops))) if ops else []

    def wait(self, what: str = "transfers with peers") -> None:
        """Wait for every transfer; under in-process recovery, `PeerLostError` naming
        ``what`` as soon as the generation is aborted (the thread left waiting lets go
        of the tensors once gloo ends the transfer)."""
        if not self._works:  # nothing in flight: no thread, and no abort to raise
            return self._kept.release()
        abort.waited(what, self._finish)

    def _finish(self) -> None:
        while self._works:  # each dropped once done: a gloo Work holds its tensors
            self._works.pop(0).wait()
        self._kept.release()


@contextlib.contextmanager
def lent(*tensors: torch.Tensor) -> Iterator[None]:
    """Around a gloo operation on ``tensors``: gloo's threads never take the GIL for
    them, and none holds them once the block is left (the module's docstring says why)."""
    kept = _Kept(tensors)
    yield
    kept.release()


class _Kept:
    """An extra reference to each tensor (a view holds its base), from before gloo takes
    its own until after gloo dropped them. torch takes the GIL where a tensor's count of
    C++ references moves between one and two (its Python object is kept alive by the
    second): with this one, gloo's never do, so gloo's threads never touch Python."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._views = [t.view(t.shape) for t in tensors]
        self._tensors = tensors
        self._counts = [t._use_count() for t in tensors]  # type: ignore[attr-defined]

    def release(self) -> None:
        deadline = time.monotonic() + _LET_GO_S
        while any(t._use_count() > n for t, n in zip(self._tensors, self._counts, strict=True)):  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                break  # something else took a reference meanwhile: nothing to wait for
            time.sleep(0.0001)
        self._views.clear()  # on this thread, which holds the GIL
