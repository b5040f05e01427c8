"""Silent data corruption: data-parallel replicas that should be identical but are not.

Every save gathers each rank's block checksums (`unbroken.format.write_plan`). Ranks may
legitimately hold different values under one key (RNG streams, data positions, per-rank
counters: the manifest then tags each value with its ``Chunk.ranks``), so unbroken
cannot tell on its own which state is replicated. `Replicated` names it: the top-level
state entries (for example ``("model", "optim")`` for ``state = {"model": ..., "optim":
...}``) whose tensors every rank holding the same region must hold bit for bit. The
rule: for a tensor under one of those names, every region (same offsets) held by two or
more ranks must have one checksum; sharded tensors (FSDP, tensor parallel) hold
different regions and are never compared.

A divergent region is named with its tensor, region and which ranks hold which value, is
recorded as an ``sdc`` event (`unbroken.run.worker.event`), and then ``action`` decides:
``"warn"`` logs and saves, ``"refuse"`` fails the save on every rank before anything is
written (`SilentCorruptionError`), ``"suspect"`` saves and writes ``suspect.json`` beside
the step's manifest, which `suspect` reads back (restore and ``unbroken`` tools can report
it). The manifest itself is unchanged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from unbroken.errors import CheckpointError
from unbroken.format.blockio import start
from unbroken.format.layout import step_dir
from unbroken.format.write_plan import Block
from unbroken.run.worker import event

__all__ = ["SUSPECT", "Divergence", "Replicated", "SilentCorruptionError", "report", "suspect"]

log = logging.getLogger(__name__)

SUSPECT = "suspect.json"


class SilentCorruptionError(CheckpointError):
    """Replicas that must be identical differ between ranks (``Replicated(action="refuse")``)."""


@dataclass(frozen=True)
class Divergence:
    """One region of one tensor whose copies differ: ``values`` maps each checksum to the
    ranks holding it."""

    key: str
    offsets: tuple[int, ...]
    values: dict[str, list[int]]

    def describe(self) -> str:
        held = "; ".join(f"ranks {r} hold {x}" for x, r in self.values.items())
        return f"tensor {self.key!r} at offsets {list(self.offsets)}: {held}"


@dataclass(frozen=True)
class Replicated:
    """Which state every data-parallel rank must hold identically, and what a save does
    when it does not (see the module docstring for the rule)."""

    names: tuple[str, ...]
    action: Literal["warn", "refuse", "suspect"] = "warn"

    def __post_init__(self) -> None:
        if self.action not in ("warn", "refuse", "suspect"):
            raise ValueError(
                f"Replicated action {self.action!r}: choose 'warn', 'refuse' or 'suspect'"
            )
        if not self.names or any(not n or "/" in n for n in self.names):
            raise ValueError(
                f"Replicated names {self.names!r}: give top-level state names such as "
                "('model', 'optim')"
            )

    def divergent(self, blocks_by_rank: list[list[Block]]) -> list[Divergence]:
        """The regions under ``names`` whose checksums differ between ranks."""
        seen: dict[tuple[str, tuple[int, ...]], dict[str, list[int]]] = {}
        for rank, blocks in enumerate(blocks_by_rank):
            for b in blocks:
                if b.key.split("/", 1)[0] in self.names:
                    seen.setdefault((b.key, b.offsets), {}).setdefault(b.xxh3, []).append(rank)
        return [
            Divergence(key, offsets, values)
            for (key, offsets), values in sorted(seen.items())
            if len(values) > 1
        ]

    def check(self, step: int, blocks_by_rank: list[list[Block]], rank: int) -> list[Divergence]:
        """Run at save time on every rank with the same gathered blocks (so every rank
        decides alike): record and act; returns what diverged for ``"suspect"``."""
        found = self.divergent(blocks_by_rank)
        if not found:
            return []
        what = "; ".join(d.describe() for d in found[:5])
        more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
        if rank == 0:
            for d in found:
                event("sdc", step=step, tensor=d.key, offsets=list(d.offsets),
                      values=d.values, action=self.action)  # fmt: skip
        message = (
            f"step {step}: data-parallel replicas differ (silent data corruption?): {what}{more}"
        )
        if self.action == "refuse":
            raise SilentCorruptionError(
                f"{message}; the save is refused. Check the ranks' hardware, or restore "
                "the last good checkpoint"
            )
        if rank == 0:
            log.warning("%s; saved anyway (%s)", message, self.action)
        return found if self.action == "suspect" else []


def record(found: list[Divergence]) -> bytes:
    """The ``suspect.json`` of a step saved with divergent replicas."""
    rows = [{"tensor": d.key, "offsets": list(d.offsets), "values": d.values} for d in found]
    return json.dumps({"suspect": "replicas differ", "divergent": rows}).encode()


def suspect(storage: object, step_dir: str) -> list[dict[str, object]] | None:
    """The divergent regions recorded for a step (``None`` if it was not marked)."""
    try:
        raw = storage.read(f"{step_dir}/{SUSPECT}")  # type: ignore[attr-defined]
    except (FileNotFoundError, KeyError):
        return None
    rows = json.loads(bytes(raw))["divergent"]
    return list(rows)


def guard(
    replicated: Replicated | None, rank: int, storage: object, step: int, blocks: list[list[Block]]
) -> None:
    """The save's check (one call from `unbroken.saving.pipeline`): rank 0 writes ``suspect.json``
    into the step's folder before the manifest commits it."""
    if replicated is None:
        return
    found = replicated.check(step, blocks, rank)
    if found and rank == 0:
        storage.write(f"{step_dir(step)}/{SUSPECT}", [record(found)])  # type: ignore[attr-defined]


def report(storage: object, step: int) -> str | None:
    """One line for tools (``unbroken show``) when ``step`` was saved as suspect."""
    rows = suspect(storage, step_dir(step))
    if not rows:
        return None
    where = ", ".join(f"{r['tensor']} ({r['values']})" for r in rows[:3])
    more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
    return f"step {step}: data-parallel replicas differed when saved: {where}{more}"


def restoring(storage: object, step: int) -> Callable[[], None]:
    """A restore of ``step`` from ``storage`` begins: its suspect mark is read now, beside
    the restore's own reads (one round trip off the restore's path). Call what this
    returns once the restore stood: if the step was saved as suspect, it says so (warning
    and event); the restore stands, as the save did."""
    marked = start(lambda: _mark(storage, step))

    def restored() -> None:
        line = marked.result()
        if line is not None:
            log.warning(
                "restore: %s; restored anyway. Unless the difference is expected, restore an "
                "earlier step (`unbroken ls`, `restore(state, step=N)`)",
                line,
            )
            event("suspect_restored", step=step, report=line[:500])

    return restored


def _mark(storage: object, step: int) -> str | None:
    try:
        return report(storage, step)
    # A damaged or forged mark, or a storage error: said, never raised (only rank 0
    # reads it, so an error would fail a restore the other ranks finished)
    except Exception as e:
        return f"step {step}: its {SUSPECT} is unreadable ({e})"
