"""Tier 0: each rank's newest snapshots in node-local shared memory.

A process that crashes and is restarted on the same node finds its state here and
restores without touching storage. Each rank owns a directory with two slots, written
alternately, so a crash in the middle of a copy never destroys the last good version:

    /dev/shm/unbroken/<job>/rank-00003/slot-0.bin   tensor bytes, back to back
    /dev/shm/unbroken/<job>/rank-00003/slot-0.json  what they are: written last

A slot counts only if its JSON exists, names this job, rank and world size, and every
block matches its checksum. Before a slot is overwritten its JSON is removed, so a
half-written slot is never mistaken for a whole one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import torch

from unbroken.errors import CheckpointError
from unbroken.format import Chunk, Manifest, TensorEntry, checksum, dtype_name
from unbroken.shards import byte_view

log = logging.getLogger("unbroken")

DEFAULT_ROOT = "/dev/shm/unbroken"
_ALIGN = 64


class MemoryTier:
    """The shared-memory snapshots of one rank of one job.

    A slot is described by an ordinary manifest (one rank, one file), so restoring from
    memory is restoring a checkpoint whose storage is this directory."""

    def __init__(self, root: str, job: str, rank: int, world_size: int) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self.dir = os.path.join(root, _safe(job), f"rank-{rank:05d}")
        os.makedirs(self.dir, exist_ok=True)
        self._buffers: dict[int, torch.Tensor] = {}
        _clean_abandoned(root, job)
        with open(os.path.join(root, _safe(job), f"owner-{rank:05d}"), "w") as f:
            f.write(str(os.getpid()))

    def _path(self, slot: int, ext: str) -> str:
        return os.path.join(self.dir, f"slot-{slot}.{ext}")

    def write(
        self,
        step: int,
        blocks: Sequence[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]],
        tree: dict[str, Any],
    ) -> None:
        """Copy ``(key, local block, offsets, global shape)`` blocks and the JSON ``tree``
        into the slot that does not hold the newest snapshot."""
        held = {m.step: slot for slot, m in self._verified()}
        slot = 1 if held.get(max(held, default=-1)) == 0 else 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(slot, "json"))  # from now on this slot is not whole
        starts, total = [], 0
        for _, t, _, _ in blocks:
            starts.append(total)
            total += -(-t.nbytes // _ALIGN) * _ALIGN
        buffer = self._buffer(slot, total)
        file = os.path.basename(self._path(slot, "bin"))
        tensors = {}
        for (key, t, offsets, shape), start in zip(blocks, starts, strict=True):
            view = buffer[start : start + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            chunk = Chunk(
                offsets=list(offsets),
                shape=list(t.shape),
                file=file,
                start=start,
                end=start + t.nbytes,
                xxh3=checksum(byte_view(view)),
            )
            tensors[key] = TensorEntry(dtype=dtype_name(t.dtype), shape=list(shape), chunks=[chunk])
        manifest = Manifest(
            step=step,
            world_size=self.world_size,
            created=time.time(),
            tensors=tensors,
            objects=[tree],
            rank_objects=[0] * self.world_size,
            files={file: buffer.numel()},
        )
        header = {"job": self.job, "rank": self.rank, "manifest": manifest.to_json().decode()}
        tmp = self._path(slot, "json.tmp")
        with open(tmp, "w") as f:
            json.dump(header, f)
        os.replace(tmp, self._path(slot, "json"))

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's shared-memory file, mapped; grown if the state grew."""
        current = self._buffers.get(slot)
        if current is None or current.numel() < nbytes:
            path = self._path(slot, "bin")
            with open(path, "ab") as f:
                f.truncate(max(nbytes, 1))
            current = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
            self._buffers[slot] = current
        return current

    def _verified(self) -> list[tuple[int, Manifest]]:
        return [(slot, m) for slot in (0, 1) if (m := self._load(slot)) is not None]

    def _load(self, slot: int) -> Manifest | None:
        where = self._path(slot, "json")
        try:
            with open(where) as f:
                header = json.load(f)
            manifest = Manifest.from_json(header["manifest"].encode(), where)
        except (FileNotFoundError, ValueError, KeyError, TypeError, CheckpointError):
            return None
        owner = (header.get("job"), header.get("rank"), manifest.world_size)
        if owner != (self.job, self.rank, self.world_size):
            log.warning("ignoring %s: it belongs to (job, rank, world) %s", where, owner)
            return None
        data = self._path(slot, "bin")
        try:
            size = os.path.getsize(data)
        except FileNotFoundError:
            return None
        if size != manifest.files.get(os.path.basename(data)):
            return None
        buffer = torch.from_file(data, shared=False, size=size, dtype=torch.uint8)
        for key, entry in manifest.tensors.items():
            chunk = entry.chunks[0]
            if checksum(byte_view(buffer[chunk.start : chunk.end])) != chunk.xxh3:
                log.warning("ignoring %s: tensor %r fails its checksum", data, key)
                return None
        return manifest

    def snapshots(self) -> dict[int, Manifest]:
        """Every whole, verified snapshot this rank holds, by step."""
        return {m.step: m for _, m in self._verified()}

    def remove(self) -> None:
        """Forget this rank's snapshots (the job finished)."""
        self._buffers.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _safe(job: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "job"


def _clean_abandoned(root: str, job: str) -> None:
    """Remove the shared memory of other jobs whose processes are all gone."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        if name == _safe(job):
            continue
        folder = os.path.join(root, name)
        pids = []
        for owner in (f for f in os.listdir(folder) if f.startswith("owner-")):
            try:
                with open(os.path.join(folder, owner)) as f:
                    pids.append(int(f.read()))
            except (OSError, ValueError):
                continue
        if pids and not any(_alive(pid) for pid in pids):
            log.info("removing shared memory of abandoned job %s", name)
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
