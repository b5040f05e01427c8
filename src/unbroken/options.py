"""The Checkpointer's options that can be wrong, checked in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class Options:
    """See `Checkpointer` for what each means. Construction refuses a value that cannot
    work, saying why."""

    keep: int | None = None
    io_threads: int = 2
    staging_buffers: int = 1
    if_busy: Literal["wait", "skip"] = "wait"
    on_error: Literal["raise", "warn"] = "raise"
    replicated_reads: Literal["each", "broadcast", "slice"] = "each"
    memory: bool = False
    replicas: int = 0

    def __post_init__(self) -> None:
        keep, replicas, reads = self.keep, self.replicas, self.replicated_reads
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint, or None to keep all")
        if self.io_threads < 1:
            raise ValueError(f"io_threads={self.io_threads}: at least one thread must write")
        if self.staging_buffers < 1:
            raise ValueError(f"staging_buffers={self.staging_buffers}: background saves need one")
        if self.if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy={self.if_busy!r}: choose 'wait' or 'skip'")
        if self.on_error not in ("raise", "warn"):
            raise ValueError(f"on_error={self.on_error!r}: choose 'raise' or 'warn'")
        if replicas < 0 or (replicas and not self.memory):
            raise ValueError(f"replicas={replicas}: replicas need memory=True, and are >= 0")
        if reads not in ("each", "broadcast", "slice"):
            raise ValueError(f"replicated_reads={reads!r}: choose 'each', 'broadcast' or 'slice'")
