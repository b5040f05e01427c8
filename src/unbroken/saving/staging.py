"""Staging: a reusable, bounded host copy of the state, so training can go on while it is
written.

An `Arena` is one host buffer (pinned when the state is on CUDA), sized from the state and
reused by every later save: copying into memory that was already touched is ~10x faster
here than into fresh pages, and host memory stays fixed. A `Stager` owns at most
``buffers`` arenas; a save that finds none free waits for one or is skipped.

The first save need not pay for fresh pages either: `Stager.reserve_for` allocates and
touches the next arena, and makes the copies' views into it, on a background thread
(`Checkpointer.prepare`), so the first background save blocks about as long as the later
ones. It holds no more memory than the first save would have: one arena, the size of the
state. Not done unasked: a job that only saves blocking never needs the arena.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from unbroken.format.shards import local_block, packed
from unbroken.job import abort, overlap
from unbroken.state import capture

Layout = list[tuple[torch.dtype, torch.Size]]  # the blocks' dtypes and shapes, in order


def _sizes(layout: Layout) -> list[int]:
    return [dtype.itemsize * math.prod(shape) for dtype, shape in layout]


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A staging buffer: pinned (page-locked, for device copies) or plain host memory. Not
    advised for transparent huge pages: where the kernel defragments for them (the default
    for advised memory), touching it stalled past the first save on a fragmented host."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class Arena:
    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()  # a reservation and a save never allocate at once
        # The views of the last save's layout into the buffer: a save with the same
        # layout (every save of a training loop) makes none (2 torch calls a tensor).
        self._views: tuple[Any, int, list[torch.Tensor]] | None = None
        self.reserving = False

    def reserve(self, layout: Layout, pin: bool) -> None:
        """Make the buffer big enough for blocks of ``layout``, every page touched (pinned:
        locked), and their views into it made: the first save makes none either."""
        try:
            with self._lock:
                _, nbytes = packed(_sizes(layout))
                if self.nbytes < nbytes:
                    self.buffer = self._views = None  # free the old buffer first
                    buffer = host_buffer(nbytes, pin)
                    if not pin:
                        buffer.zero_()  # page faults now, not in the first save
                    self.buffer = buffer
                self._views_of(layout)
        finally:
            self.reserving = False

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def ready_for(self, layout: Layout) -> bool:
        """Whether a save of blocks of ``layout`` would find its views made."""
        views = self._views  # dropped with its buffer: views imply one
        return views is not None and views[0] == layout

    def stage(
        self, blocks: Sequence[torch.Tensor], deferred: Sequence[bool] = ()
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Copy ``blocks`` (contiguous, on CPU or CUDA) into the arena; return the copies and,
        for CUDA blocks, an event that completes when they have landed.

        On return the caller may modify the originals at once: CPU copies are done, and the
        current CUDA stream is made to wait for the side-stream copies, so kernels it runs
        next cannot change a tensor before it has been copied. Blocks marked ``deferred``
        are the exception (`unbroken.job.overlap`): the CPU ones are left to the caller
        to copy, the CUDA ones are queued last and the current stream does not wait."""
        _, total = packed(t.nbytes for t in blocks)
        later = list(deferred) or [False] * len(blocks)
        on_cuda = [t for t in blocks if t.is_cuda]
        with self._lock:  # waits for a reservation under way: it has done part of the work
            if self.buffer is None or self.buffer.numel() < total:
                self.buffer = self._views = None  # free the old buffer before allocating anew
                self.buffer = host_buffer(total, pin=bool(on_cuda))
            copies = self._views_of([(t.dtype, t.shape) for t in blocks])
        for dst, src, defer in zip(copies, blocks, later, strict=True):
            if not src.is_cuda and not defer:
                dst.copy_(src)
        if not on_cuda:
            return copies, None
        return copies, self._side_copies(copies, blocks, later)

    def _views_of(self, layout: Layout) -> list[torch.Tensor]:
        """The copies of blocks of ``layout``: views into the buffer, made once for a
        layout (every save of a training loop has the same: 2 torch calls a tensor)."""
        assert self.buffer is not None
        views = self._views
        if views is None or views[0] != layout or views[1] != self.buffer.data_ptr():
            sizes = _sizes(layout)
            copies = [
                self.buffer[o : o + n].view(dtype).view(shape)
                for o, n, (dtype, shape) in zip(packed(sizes)[0], sizes, layout, strict=True)
            ]
            views = self._views = (layout, self.buffer.data_ptr(), copies)
        return list(views[2])

    def _side_copies(
        self, copies: list[torch.Tensor], blocks: Sequence[torch.Tensor], later: list[bool]
    ) -> torch.cuda.Event:
        device = next(t for t in blocks if t.is_cuda).device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        self._stream.wait_stream(main)  # copy what the queued kernels will have produced
        for deferred in (False, True):
            with torch.cuda.stream(self._stream):
                for dst, src, defer in zip(copies, blocks, later, strict=True):
                    if src.is_cuda and defer == deferred:
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(self._stream)  # keep temporaries alive until copied
            if not deferred:
                main.wait_stream(self._stream)  # only the copies later kernels may change
        done = torch.cuda.Event()
        done.record(self._stream)
        return done


class Stager:
    """Hands out at most ``buffers`` arenas; thread-safe (the save worker releases them)."""

    def __init__(self, buffers: int) -> None:
        overlap.install()  # from the first step on: the first save already overlaps
        self._free = [Arena() for _ in range(buffers)]
        self._cond = threading.Condition()

    def acquire(self, wait: bool) -> Arena | None:
        with self._cond:
            if not wait and not self._free:
                return None
            while not self._cond.wait_for(lambda: bool(self._free), abort.poll_s()):
                abort.check("waiting for a staging buffer")
            return self._free.pop()

    def reserve_for(self, state: Mapping[str, Any]) -> None:
        """Start sizing, on a background thread, the arena the next save takes for the
        tensors of ``state`` as a save would capture them (pinned if any is on CUDA).
        Cheap when it is ready already."""
        tensors, _ = capture(state)
        blocks = [local_block(t)[0] for t in tensors.values()]
        layout = [(t.dtype, t.shape) for t in blocks]
        with self._cond:
            if not self._free:
                return
            arena = self._free[-1]  # the one `acquire` pops next
            if arena.ready_for(layout) or arena.reserving:
                return
            arena.reserving = True
        pin = any(t.is_cuda for t in blocks)
        threading.Thread(
            target=arena.reserve, args=(layout, pin), name="unbroken-reserve", daemon=True
        ).start()

    def release(self, arena: Arena) -> None:
        with self._cond:
            self._free.append(arena)
            self._cond.notify()

    @property
    def nbytes(self) -> int:
        """Host memory held by the arenas that are not in use."""
        with self._cond:
            return sum(a.nbytes for a in self._free)
