"""Corruption (issue 17, item 2): a bit flipped in, a truncation of or the deletion of each
kind of file a checkpoint has (a shard's data, a shard's header, the manifest, the latest
pointer) is detected and named, and restore falls back to the older step where the damage
makes the newest one unusable. Data-file damage on restore paths (memory, replicas) is in
tests/test_fallback.py; this table adds the regions and files it does not cover."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from unbroken import Checkpointer, CorruptCheckpointError
from unbroken.format.audit import verify
from unbroken.format.directory import Directory
from unbroken.format.layout import LATEST, MANIFEST, step_dir
from unbroken.storage import open_storage

SHARD = "r00000-000.safetensors"


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(raw)


def _header_end(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# target -> damage -> (file relative to the checkpoint, how to damage it)
DAMAGE = {
    ("data", "flip"): (f"{step_dir(2)}/{SHARD}", lambda p: _flip(p, _header_end(p) + 3)),
    ("data", "truncate"): (f"{step_dir(2)}/{SHARD}", lambda p: os.truncate(p, _header_end(p))),
    ("data", "delete"): (f"{step_dir(2)}/{SHARD}", os.remove),
    ("header", "flip"): (f"{step_dir(2)}/{SHARD}", lambda p: _flip(p, 20)),
    ("header", "truncate"): (f"{step_dir(2)}/{SHARD}", lambda p: os.truncate(p, 12)),
    ("manifest", "flip"): (f"{step_dir(2)}/{MANIFEST}", lambda p: _flip(p, 40)),
    ("manifest", "truncate"): (f"{step_dir(2)}/{MANIFEST}", lambda p: os.truncate(p, 50)),
    ("manifest", "delete"): (f"{step_dir(2)}/{MANIFEST}", os.remove),
    ("latest", "flip"): (LATEST, lambda p: _flip(p, 2)),
    ("latest", "truncate"): (LATEST, lambda p: os.truncate(p, 3)),
    ("latest", "delete"): (LATEST, os.remove),
}
# A restore of the newest step then gives the older step, except where the newest is still
# whole: restore does not trust the header's bytes (ranges come from the manifest) nor the
# pointer (the listing finds the newest step when the pointer is unreadable).
INTACT = {("header", "flip"), ("latest", "flip"), ("latest", "truncate"), ("latest", "delete")}


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((64,), value), "b": torch.arange(32.0) * value}


@pytest.mark.parametrize("case", sorted(DAMAGE), ids="-".join)
def test_damage_is_detected_named_and_restore_falls_back(tmp_path, case, caplog) -> None:
    path = tmp_path / "ckpt"
    ckpt = Checkpointer(path)
    for saved in (1, 2):
        ckpt.save(saved, _state(float(saved)))
    relative, damage = DAMAGE[case]
    damage(path / relative)
    _detected(path, case, relative)
    live = _state(-1.0)
    step = ckpt.restore(live)
    ckpt.close()
    assert step == (2 if case in INTACT else 1)
    assert all(torch.equal(live[k], v) for k, v in _state(float(step)).items())
    # The fall-back is loud and names the damaged step; a step without its manifest was
    # never committed (the format's rule), so passing over it is silent.
    if step == 1 and case != ("manifest", "delete"):
        assert step_dir(2) in caplog.text


def _detected(path: Path, case: tuple[str, str], relative: str) -> None:
    """The damage is found by the check that owns it, and named (file, tensor, step)."""
    target, how = case
    directory = Directory(open_storage(str(path)), str(path))
    if target == "latest":  # the pointer is advisory: the listing still finds step 2
        assert directory.latest() == 2
        return
    if target == "manifest":
        if how == "delete":  # an uncommitted step: it no longer exists
            assert directory.steps() == [1]
            return
        with pytest.raises(CorruptCheckpointError, match=MANIFEST) as info:
            directory.manifest(2)
        assert step_dir(2) in str(info.value)
        return
    damage = verify(directory, directory.manifest(2))
    assert damage and all(d.file == SHARD for d in damage), damage
    if (target, how) in (("data", "flip"), ("header", "flip")):
        assert any(d.tensor in ("a", "b") or "header" in d.problem for d in damage), damage


# A shared-memory slot's description (slot-N.json: job, rank, the snapshot's manifest):
# damaged or forged, the slot does not count, and restore takes storage's older step.
DESCRIPTION = {
    "flip": lambda p: _flip(p, 30),
    "truncate": lambda p: os.truncate(p, 20),
    "delete": os.remove,
    "not an object": lambda p: p.write_text("[1, 2]"),
    "deep nesting": lambda p: p.write_text('{"job": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "manifest not text": lambda p: p.write_text('{"job": "j", "rank": 0, "manifest": 5}'),
    "non-UTF-8": lambda p: p.write_bytes(b"\xff\xfe{" + p.read_bytes()),
}


@pytest.mark.parametrize("how", sorted(DESCRIPTION))
def test_a_damaged_snapshot_description_is_passed_over_for_storage(tmp_path, how) -> None:
    def make() -> Checkpointer:
        return Checkpointer(tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "shm"))

    ckpt = make()
    ckpt.save(1, _state(1.0))
    ckpt.snapshot(2, _state(2.0))
    ckpt.close()
    [description] = (tmp_path / "shm").glob("*/rank-00000/slot-*.json")
    DESCRIPTION[how](description)
    live = _state(-1.0)
    restored = make()
    assert restored.restore(live) == 1
    assert restored.last_restore is not None and restored.last_restore.origin.kind == "storage"
    assert all(torch.equal(live[k], v) for k, v in _state(1.0).items())
    restored.close()
