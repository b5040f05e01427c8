"""The mark of a step saved with divergent data-parallel replicas: ``suspect.json`` beside
its manifest (`unbroken.sdc` writes it), read back here without torch, so that
``unbroken show`` can say SUSPECT without importing it."""

from __future__ import annotations

import json

from unbroken.format.layout import step_dir

SUSPECT = "suspect.json"


def suspect(storage: object, folder: str) -> list[dict[str, object]] | None:
    """The divergent regions recorded for a step (``None`` if it was not marked)."""
    try:
        raw = storage.read(f"{folder}/{SUSPECT}")  # type: ignore[attr-defined]
    except (FileNotFoundError, KeyError):
        return None
    rows = json.loads(bytes(raw))["divergent"]
    return list(rows)


def report(storage: object, step: int) -> str | None:
    """One line for tools (``unbroken show``) when ``step`` was saved as suspect."""
    rows = suspect(storage, step_dir(step))
    if not rows:
        return None
    where = ", ".join(f"{r['tensor']} ({r['values']})" for r in rows[:3])
    more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
    return f"step {step}: data-parallel replicas differed when saved: {where}{more}"
