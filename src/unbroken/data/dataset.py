"""`TokenDataset`: fixed-length samples cut from memory-mapped token files."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from unbroken.data.files import DataFileError, TokenFile


class TokenDataset(Dataset[torch.Tensor]):
    """Samples of ``seq_len + 1`` consecutive tokens from one or more token files.

    Sample ``i`` is a 1-D ``int64`` tensor; a model takes ``sample[:-1]`` as input and
    ``sample[1:]`` as targets. Samples start every ``seq_len`` tokens within a file (each
    token is a target once) and never span two files, so the first sample of each file
    follows all samples of the files before it, in the order given.

    Opening costs a ``stat`` and a small JSON read per file; the tokens are memory-mapped,
    so a process that restarts on the same node re-attaches to pages the page cache still
    holds, with nothing read again. Pickling (``DataLoader`` workers under ``spawn``)
    sends the file names, never the tokens; each worker maps the files itself.

    Raises `DataFileError`, naming the file, for a missing or damaged sidecar, a file
    whose size does not match its sidecar, or one with fewer than ``seq_len + 1`` tokens.
    `verify` checks every checksum (it reads every byte: call it when you want that).
    """

    def __init__(self, files: Sequence[str | Path] | str | Path, seq_len: int) -> None:
        if isinstance(files, str | Path):
            files = [files]
        if not files:
            raise ValueError("TokenDataset needs at least one token file")
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, not {seq_len}")
        self.paths = [Path(f) for f in files]
        self.seq_len = seq_len
        self._attach()

    def _attach(self) -> None:
        self.files = [TokenFile.open(p) for p in self.paths]
        counts = []
        for f in self.files:
            n = (f.count - 1) // self.seq_len
            if n < 1:
                raise DataFileError(
                    f"{f.path}: too short: {f.count} tokens, fewer than one sample of "
                    f"seq_len + 1 = {self.seq_len + 1}; use a smaller seq_len or drop the file"
                )
            counts.append(n)
        self._ends = np.cumsum(counts).tolist()

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        which = bisect.bisect_right(self._ends, index)
        first = index - (self._ends[which - 1] if which else 0)
        start = first * self.seq_len
        window = self.files[which].tokens[start : start + self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))

    def verify(self) -> None:
        """Check every file's checksum; raise `DataFileError` naming the first bad one."""
        for f in self.files:
            f.verify()

    @property
    def tokens(self) -> int:
        """Tokens in all files together."""
        return sum(f.count for f in self.files)

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "seq_len": self.seq_len}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.paths, self.seq_len = state["paths"], state["seq_len"]
        self._attach()
