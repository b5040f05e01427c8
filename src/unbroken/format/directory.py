"""A checkpoint directory on any `Storage`: which steps are committed, their manifests,
the ``latest`` pointer, the leftovers of failed saves, deletion. Which steps to delete
is `unbroken.retention`'s to say, applied by `unbroken.saving.committed`.

A step exists only once its manifest does (see `unbroken.format.layout`): every lookup here
goes by the manifest, so a directory a crashed save left behind is never listed, read,
or counted by retention; the next Checkpointer to open removes it.
"""

from __future__ import annotations

import json
from typing import Any

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.layout import (
    LATEST,
    MANIFEST,
    Encoded,
    Manifest,
    parse,
    parse_step_dir,
    step_dir,
)
from unbroken.format.validate import latest_step
from unbroken.run import faults
from unbroken.storage import Storage

# A ``latest`` pointer that is absent, a folder, a link or malformed: the listing says.
_NO_POINTER = (FileNotFoundError, IsADirectoryError, CorruptCheckpointError, ValueError,
               KeyError, TypeError)  # fmt: skip


class Directory:
    """The checkpoints under one storage root. ``path`` names it in messages."""

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage = storage
        self.path = path

    # -- reading -----------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Directories without a manifest are not listed."""
        found = []
        for name in self.storage.list(""):
            step = parse_step_dir(name)
            if step is not None and self._committed(name):
                found.append(step)
        return sorted(found)

    def is_committed(self, step: int) -> bool:
        return self._committed(step_dir(step))

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest committed step)."""
        if step is None:
            steps = self.steps()
            if not steps:
                raise CheckpointError(f"{self.path} holds no committed checkpoint")
            step = steps[-1]
        return self.parse(step, self.manifest_bytes(step))

    def manifest_bytes(self, step: int) -> bytes:
        """The stored manifest of ``step``, unparsed; a clear error if it is not committed."""
        try:
            return self.storage.read(f"{step_dir(step)}/{MANIFEST}")
        except (FileNotFoundError, NotADirectoryError):  # the step's name may be a file's
            raise CheckpointError(
                f"{self.path} has no committed checkpoint for step {step}; committed steps: "
                f"{_summary(self.steps())}"
            ) from None
        except (IsADirectoryError, PermissionError) as e:  # a link is refused likewise
            raise CorruptCheckpointError(
                f"{self.path}/{step_dir(step)}/{MANIFEST} cannot be read ({e.strerror}): "
                "the step is damaged; restore an earlier one (see `unbroken ls`), or make "
                "the manifest a readable file again"
            ) from None

    def parse(self, step: int, data: bytes) -> Manifest:
        """``data``, the manifest of ``step``, checked (see `unbroken.format.validate`)."""
        return self.built(step, parse(data, self.manifest_path(step)))

    def manifest_path(self, step: int) -> str:
        """Names the manifest of ``step`` in messages."""
        return f"{self.path}/{step_dir(step)}/{MANIFEST}"

    def built(self, step: int, raw: dict[str, Any]) -> Manifest:
        """The manifest of ``step`` from ``raw``, which `unbroken.format.layout.parse`
        checked, every part of it."""
        where = self.manifest_path(step)
        manifest = Manifest.built(raw, where)
        if manifest.step != step:
            raise CheckpointError(f"{where} says it is step {manifest.step}, not {step}")
        return manifest

    def latest(self) -> int | None:
        """The newest committed step, from the ``latest`` pointer (no listing, which is
        slow and throttled on object stores); by listing if the pointer is absent or
        points at a step that is gone."""
        step = self.pointed()
        if step is None or self.is_committed(step):
            return step
        steps = self.steps()
        return steps[-1] if steps else None

    def pointed(self) -> int | None:
        """The step the ``latest`` pointer names, not checked to be committed (a caller
        about to read its manifest finds out that way, a request sooner); by listing if
        the pointer is absent or malformed."""
        try:
            return latest_step(self.storage.read(LATEST))  # validate: hostile pointers
        except _NO_POINTER:
            steps = self.steps()
            return steps[-1] if steps else None

    def leftovers(self) -> list[str]:
        """Step directories without a manifest (and anything else under a step's name: a
        link, a file), and temporary copies of the ``latest`` pointer: what failed or
        crashed saves left (a process killed while replacing the pointer leaves its
        temporary file; tests/test_crash.py found them piling up)."""
        return [
            name
            for name in self.storage.list("")
            if (parse_step_dir(name) is not None and not self._committed(name))
            or (name.startswith(f"{LATEST}.") and name.endswith(".tmp"))
        ]

    # -- writing -----------------------------------------------------------------------

    def commit(self, manifest: Manifest | Encoded) -> None:
        """Write ``manifest`` atomically: from now on its step exists. Never replaces a
        step another writer committed meanwhile."""
        faults.point("manifest-commit")
        try:
            self.storage.commit(f"{step_dir(manifest.step)}/{MANIFEST}", manifest.to_json())
        except FileExistsError:
            raise CheckpointError(
                f"{self.path}: step {manifest.step} was committed by another writer meanwhile"
            ) from None

    def move_latest(self, step: int) -> None:
        """Point ``latest`` at ``step`` (committed). Readers fall back to listing if this
        fails, so a caller may treat a failure as a warning."""
        faults.point("latest-pointer")
        self.storage.replace(LATEST, json.dumps({"step": step}).encode())

    def clear_leftovers(self) -> None:
        """Remove the leftovers of failed saves. Only when nobody can be writing them:
        saves are collective and persisted one at a time, so before a save begins."""
        for name in self.leftovers():
            self.storage.delete(name)

    def delete(self, step: int) -> None:
        """Delete ``step``: its manifest first, from which moment no reader sees a
        half-deleted checkpoint, then its folder. A step folder that is a symbolic link
        (a fine-tune run linking a pre-training step) loses the link only, at once: the
        local storage never deletes through a link (`unbroken.storage.local`)."""
        self.storage.delete(f"{step_dir(step)}/{MANIFEST}")
        faults.point("retention-gc")
        self.storage.delete(step_dir(step))

    def _committed(self, folder: str) -> bool:
        try:
            self.storage.size(f"{folder}/{MANIFEST}")
            return True
        except (FileNotFoundError, NotADirectoryError):  # a file named like a step folder
            return False  # is no step: a leftover, removed as a link there is
        except CorruptCheckpointError:  # a link: counted, and found damaged when read
            return True

    def __repr__(self) -> str:
        return f"Directory({self.path!r})"


def _summary(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps[-10:])) + (" ..." if len(steps) > 10 else "")
