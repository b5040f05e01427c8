"""Fault specs for ``unbroken run --inject-fault`` (and ``$UNBROKEN_INJECT_FAULT``)::

    kill rank=1 step=40        rank 1 SIGKILLs itself once it reaches step 40
    hang rank=0 step=60        rank 0 stops making progress forever
    kill-node node=1 step=80   simulated node 1 dies: all its ranks and its memory

Several are ``;``-separated. The worker side fires them (`unbroken.run.worker`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = {"kill": "rank", "hang": "rank", "kill-node": "node"}
EXAMPLES = "'kill rank=1 step=40', 'hang rank=0 step=60' or 'kill-node node=1 step=80'"


@dataclass(frozen=True)
class Fault:
    """One fault to inject: ``kind`` at ``step`` on ``target`` (a rank, or a node for
    kill-node). ``index`` is its position in the launch's list: it fires once per launch."""

    kind: str
    target: int
    step: int
    index: int = 0

    def __str__(self) -> str:
        return f"{self.kind} {KINDS[self.kind]}={self.target} step={self.step}"


def parse(spec: str) -> list[Fault]:
    """Parse ``;``-separated faults; a ValueError names the text that is wrong."""
    faults: list[Fault] = []
    for text in (part.strip() for part in spec.split(";")):
        if text:
            faults.append(_parse_one(text, len(faults)))
    return faults


def _parse_one(text: str, index: int) -> Fault:
    def bad(why: str) -> ValueError:
        return ValueError(f"bad fault {text!r}: {why}; write e.g. {EXAMPLES}")

    kind, *pairs = text.split()  # text is not blank: parse() skips those
    if kind not in KINDS:
        raise bad(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
    values: dict[str, int] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not re.fullmatch(r"\d+", value):
            raise bad(f"{pair!r} is not key=N with N a non-negative integer")
        if key not in (KINDS[kind], "step"):
            raise bad(f"{kind} takes {KINDS[kind]}= and step=, not {key}=")
        if key in values:
            raise bad(f"{key}= given twice")
        values[key] = int(value)
    missing = [k for k in (KINDS[kind], "step") if k not in values]
    if missing:
        raise bad(f"missing {' and '.join(k + '=' for k in missing)}")
    return Fault(kind, values[KINDS[kind]], values["step"], index)
