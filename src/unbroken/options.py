"""The Checkpointer's options that can be wrong, checked in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from unbroken.retention import Retention


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options of a `Checkpointer`. Construction refuses a value that cannot work,
    saying why.

    Args:
        keep: which committed checkpoints to keep: a `unbroken.retention` rule
            (``KeepLast(3) | KeepEvery(1000)``...), or an int K for ``KeepLast(K)``;
            ``None`` keeps all. Rank 0 deletes in the background.
        policy: what `Checkpointer.step` takes at each step: a `unbroken.policies.Policy`
            (memory snapshots and saves, each by its own trigger) or ``Auto``.
        preemption: save at the next `Checkpointer.step` after one of these signals
            (SIGTERM by default), then exit (`unbroken.preemption`).
        process_group: the ranks that checkpoint together; default: all of them.
        timeout: how long a rank waits for the others during save or restore (seconds).
        io_threads: parallel file writers and readers per rank, for restores and
            blocking saves; a background save uses one, so it takes a core from training
            at most.
        staging_buffers: host copies of the state that background saves may hold at once.
        if_busy: what ``save(blocking=False)`` does when every staging buffer still holds
            a save that is persisting: ``"wait"`` for one to free, or ``"skip"`` this step.
        on_error: what the next ``save()`` does about a background save that failed:
            ``"raise"`` it, or ``"warn"`` and go on.
        replicated_reads: how a restore reads tensors that every rank needs whole (DDP
            parameters and optimizer state): ``"each"`` rank reads them; ``"broadcast"``:
            rank 0 reads them and broadcasts; ``"slice"``: the ranks share the reading
            and broadcast what each read. The last two cut storage traffic by the world
            size, which is what counts on object stores.
        memory: keep `snapshot`s in this node's shared memory (``memory_dir``, default
            ``$UNBROKEN_MEMORY_DIR`` or /dev/shm/unbroken-<uid>), so a process restarted
            on the same node restores without touching storage.
        replicas: with ``memory``, also keep each snapshot in the shared memory of this
            many peers on other nodes (sent in the background over the checkpointer's
            gloo group), so the ranks of a lost node restore from their peers.
        job: names the job in shared memory, so another job's snapshots are never
            used; default: torchrun's run id (unless torchrun's "none") with the
            checkpoint location made absolute. Its folder name holds a hash of it, so
            names that read alike once made safe for a file name never share one.
    """

    keep: int | Retention | None = None
    io_threads: int = 2
    staging_buffers: int = 1
    if_busy: Literal["wait", "skip"] = "wait"
    on_error: Literal["raise", "warn"] = "raise"
    replicated_reads: Literal["each", "broadcast", "slice"] = "each"
    memory: bool = False
    replicas: int = 0

    def __post_init__(self) -> None:
        keep, replicas, reads = self.keep, self.replicas, self.replicated_reads
        if isinstance(keep, int) and keep < 1:
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
