"""A restore that fails leaves the live state as it was."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Backup:
    """A host copy of every live tensor a restore is about to overwrite, put back if the
    restore fails: a damaged block met midway leaves the state as it was. It costs one
    host copy of this rank's restored tensors (memory, and a copy out of the device),
    the price of never leaving a model half overwritten."""

    def __init__(self, regions: Iterable[torch.Tensor | None]) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
        for region in regions:
            if region is None or not region.numel():
                continue
            ident = (region.data_ptr(), region.dtype, tuple(region.shape))
            if ident not in seen:  # tied tensors: once
                seen.add(ident)
                self._saved.append((region, region.detach().to("cpu", copy=True)))

    def put_back(self) -> None:
        with torch.no_grad():
            for region, copy in self._saved:
                region.copy_(copy)
