"""`ResumableSampler` and `ResumableLoader`: a distributed data order whose position is
two integers, the same on every rank, so it resumes exactly and reshards trivially.

Epoch ``e`` visits the samples in one permutation, drawn from ``(seed, e)`` alone (NumPy's
PCG64, stable across platforms and releases). The *global position* ``p`` counts the
samples of that permutation already handed out, over all ranks. The next global batch is
``order[p : p + batch_size * world_size]``, cut into ``world_size`` consecutive slices, one
per rank in rank order; then ``p`` moves on by ``batch_size * world_size``. An epoch ends
when fewer samples than one global batch remain (they are left out, as with
``drop_last=True``, so every rank always gets a full batch).

Exactness. On the same number of ranks, a restored run yields exactly the batches an
uninterrupted run would have, from the next one on. On another number of ranks (or
another per-rank batch size), the position is still ``p`` and the order is still the same
permutation, so the rest of the epoch is ``order[p:]`` again: no sample seen before the
checkpoint comes back and none is skipped. What changes is how ``order[p:]`` is grouped
into batches (they are now ``batch_size * new_world`` samples long), and so which samples
fall into the tail that the epoch leaves out (fewer than one global batch). From the next
epoch on, the run is the one a job started on the new number of ranks would run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch.distributed as dist
from numpy.random import PCG64, Generator
from torch.utils.data import DataLoader, Sampler


class ResumableSampler(Sampler[list[int]]):
    """Batches of sample indices for this rank (a *batch* sampler: pass it to
    ``DataLoader(dataset, batch_sampler=sampler)``, or to torchdata's
    ``StatefulDataLoader``).

    Iterating yields the rest of the current epoch, then moves to the next epoch, so
    ``for batch in loader`` is one epoch. The state (`state_dict`) is the position of
    the next batch this sampler will hand out: exact on its own, or with a
    ``DataLoader`` without workers; with workers, which fetch batches ahead, checkpoint a
    `ResumableLoader` (or a ``StatefulDataLoader``) instead, whose position counts only
    the batches the training loop received.

    ``rank`` and ``world_size`` default to the default process group's (0 and 1 without
    one). They are not part of the state: a checkpoint restores on any number of ranks.
    """

    def __init__(
        self,
        dataset: Sized | int,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        grouped = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if grouped else 0)
        self.world_size = (
            world_size if world_size is not None else (dist.get_world_size() if grouped else 1)
        )
        if batch_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"batch_size {batch_size} must be positive and rank {self.rank} within "
                f"world_size {self.world_size}"
            )
        if self.num_samples < batch_size * self.world_size:
            raise ValueError(
                f"{self.num_samples} samples are fewer than one global batch "
                f"({batch_size} x {self.world_size} ranks); use a smaller batch_size"
            )
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of sample indices that epoch ``epoch`` visits."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                rng = Generator(PCG64([self.seed, epoch]))
                perm = rng.permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            self._order = (epoch, perm)
        return self._order[1]

    def advance(self, epoch: int, position: int) -> tuple[int, int]:
        """The position after the global batch at ``(epoch, position)``, moved on to the
        next epoch when no full global batch is left in this one."""
        return self._normal(epoch, position + self.global_batch)

    def _normal(self, epoch: int, position: int) -> tuple[int, int]:
        if position + self.global_batch > self.num_samples:
            return epoch + 1, 0
        return epoch, position

    def __iter__(self) -> Iterator[list[int]]:
        epoch, position = self._normal(self.epoch, self.position)
        order = self.order(epoch)
        while True:
            first = position + self.rank * self.batch_size
            batch = order[first : first + self.batch_size].tolist()
            # The state moves on before the batch leaves: a StatefulDataLoader snapshots
            # it right after taking the batch, and a checkpoint taken after the step
            # that used this batch must resume at the next one.
            after = self.advance(epoch, position)
            self.epoch, self.position = after
            yield batch
            if after[0] != epoch:
                return
            position = after[1]

    def __len__(self) -> int:
        """Batches left in the current epoch (all of them at its start)."""
        return self.remaining(self.epoch, self.position)

    def remaining(self, epoch: int, position: int) -> int:
        """Batches left in the epoch from ``(epoch, position)`` on."""
        return (self.num_samples - self._normal(epoch, position)[1]) // self.global_batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("samples", "seed", "shuffle"):
            saved, live = state_dict[key], getattr(self, _ATTRS[key])
            if saved != live:
                raise ValueError(
                    f"the saved data position is for {key} = {saved!r} but this sampler "
                    f"has {live!r}: the dataset or the sampler changed since the checkpoint; "
                    "restore with the same data, or start a new run"
                )
        # On fewer or more ranks, what is left of the epoch may be short of a global batch.
        self.epoch, self.position = self._normal(
            int(state_dict["epoch"]), int(state_dict["position"])
        )


_ATTRS = {"samples": "num_samples", "seed": "seed", "shuffle": "shuffle"}


class ResumableLoader:
    """A ``DataLoader`` over a `ResumableSampler`, as a `Stateful` whose position counts
    the batches the training loop *received*: those its workers prefetched and the loop
    never saw are fetched again after a restore.

    >>> loader = ResumableLoader(DataLoader(dataset, batch_sampler=sampler, num_workers=2))
    >>> state = {"model": model, "data": loader, ...}
    >>> for batch in loader: ...   # the rest of the current epoch

    The state is the sampler's (two integers, the same on every rank), so it restores on
    any number of ranks and with any number of workers.
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        sampler = loader.batch_sampler
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(
                "ResumableLoader needs DataLoader(dataset, batch_sampler=ResumableSampler(...))"
            )
        self.loader = loader
        self.sampler = sampler
        self.epoch, self.position = sampler.epoch, sampler.position

    def __iter__(self) -> Iterator[Any]:
        # Batches the last iterator fetched but never handed over are fetched again.
        self.sampler.epoch, self.sampler.position = self.epoch, self.position
        for batch in self.loader:
            self.epoch, self.position = self.sampler.advance(
                *self.sampler._normal(self.epoch, self.position)
            )
            yield batch

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return self.sampler.remaining(self.epoch, self.position)

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict)
        self.epoch, self.position = self.sampler.epoch, self.sampler.position
