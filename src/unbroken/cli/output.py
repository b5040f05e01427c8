"""What ``unbroken ls|show|verify --json`` print: one JSON object each, for scripts.

The keys are part of the command line's contract (listed in the README's command-line
section): add keys if needed, never rename or remove one. Sizes are in bytes, times in
seconds since the epoch. `verdicts` are the lines ``unbroken verify`` prints without it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from unbroken.errors import CheckpointError

if TYPE_CHECKING:  # at run time only ``show`` needs torch, and imports it itself
    from unbroken.format.audit import Damage
    from unbroken.format.directory import Directory
    from unbroken.format.layout import Manifest


def dump(obj: dict[str, Any]) -> None:
    # default=repr: a non-tensor value JSON cannot hold is shown as Python writes it.
    print(json.dumps(obj, indent=2, default=repr))


def checkpoint(m: Manifest) -> dict[str, Any]:
    return {
        "step": m.step,
        "nbytes": m.nbytes,
        "tensors": len(m.tensors),
        "ranks": m.world_size,
        "created": m.created,
    }


def ls(
    path: str, directory: Directory, steps: list[int], subfolders: dict[str, Directory]
) -> dict[str, Any]:
    """``checkpoints`` of ``path`` itself; where it has none, ``subfolders`` lists the
    folders directly under it that do, each as ``{"path", "checkpoints"}``. A step whose
    manifest cannot be read is listed as ``{"step", "damaged"}``."""
    return {
        "path": path,
        "checkpoints": [_listed(directory, s) for s in steps],
        "subfolders": [
            {"path": sub, "checkpoints": [_listed(d, s) for s in d.steps()]}
            for sub, d in subfolders.items()
        ],
    }


def _listed(directory: Directory, step: int) -> dict[str, Any]:
    """`checkpoint` of ``step``, or ``{step, damaged}`` (why its manifest cannot be read)."""
    try:
        return checkpoint(directory.manifest(step))
    except CheckpointError as e:
        return {"step": step, "damaged": str(e)}


def any_damaged(listing: dict[str, Any]) -> bool:
    """Whether an `ls` result lists a step whose manifest cannot be read."""
    found = [*listing["checkpoints"], *(c for s in listing["subfolders"] for c in s["checkpoints"])]
    return any("damaged" in c for c in found)


def show(path: str, m: Manifest) -> dict[str, Any]:
    from unbroken.tree import leaves

    return {
        "path": path,
        **checkpoint(m),
        "files": len(m.files),
        "format_version": m.version,
        "tensor_list": [
            {
                "name": key,
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "blocks": len(entry.chunks),
                "nbytes": sum(c.nbytes for c in entry.chunks),
            }
            for key, entry in m.tensors.items()
        ],
        "state": dict(leaves(m.objects_for(0))),
        "state_versions": len(m.objects),
    }


def verdicts(step: int, damage: Sequence[Damage]) -> list[str]:
    """What ``unbroken verify`` prints for ``step`` (rich markup): one ``DAMAGED`` line
    per problem, naming the file (and the tensor), or one ``OK`` line."""
    if not damage:
        return [f"[green]OK[/green] step {step}: every checksum matches"]
    lines = []
    for d in damage:
        where = d.file + (f", tensor {d.tensor!r}" if d.tensor else "")
        lines.append(f"[red]DAMAGED[/red] step {step}: {escape(f'{where}: {d.problem}')}")
    return lines


def verify(path: str, results: Sequence[tuple[Manifest, list[Damage]]]) -> dict[str, Any]:
    return {
        "path": path,
        "ok": not any(damage for _, damage in results),
        "steps": [
            {
                "step": m.step,
                "ok": not damage,
                "nbytes": sum(c.nbytes for e in m.tensors.values() for c in e.chunks),
                "damage": [
                    {"file": d.file, "tensor": d.tensor, "problem": d.problem} for d in damage
                ],
            }
            for m, damage in results
        ],
    }
