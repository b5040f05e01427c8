"""Tiers 0 and 1: snapshots in node-local shared memory, and replicas of them on peers.

A process that crashes and is restarted on the same node finds its state here and
restores without touching storage; a rank whose whole node was lost gets its state back
from the replica a peer on another node holds. Every copy lives in one of a few slots
(three for a rank's own, two for a replica), and a new copy never overwrites the newest
whole one, so a crash in the middle of a copy never destroys the last good one:

    <root>/<job>/rank-00003/slot-0.bin            rank 3's own snapshot: tensor bytes
    <root>/<job>/rank-00003/slot-0.json           what they are, written last
    <root>/<job>/replicas/rank-00001/slot-1.bin   a replica of rank 1's snapshot

A slot counts only if its JSON exists, names this job, the owning rank and the world size,
and, once chosen for a restore, every block matches its checksum. The JSON holds an
ordinary manifest (one rank, one file), so restoring from memory is restoring a
checkpoint whose storage is the slot's directory. Before a slot is overwritten its JSON
is removed, so a half-written slot is never mistaken for a whole one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading

import torch

from unbroken.access import Access, read_own
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.layout import Manifest, verify_block
from unbroken.format.shards import byte_view
from unbroken.format.validate import snapshot_description
from unbroken.memory.partners import partners, replica_layout
from unbroken.memory.paths import clean_abandoned, folder_name, private_root, rank_of
from unbroken.run import contract

__all__ = ["OWN_SLOTS", "Block", "MemoryTier", "Slots", "partners", "replica_layout"]

log = logging.getLogger("unbroken")

# A rank's own: the newest whole (with replicas, the newest the peers hold too: see
# `Slots.keep`), one checksummed or replicated in the background, and one the next snapshot
# copies into without waiting, mapped only if the one before is still in flight.
OWN_SLOTS = 3
Block = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]  # key, data, offsets, shape


class Slots:
    """``count`` slots in one directory, holding snapshots of rank ``owner``: a new one
    never overwrites the newest whole slot, nor one still being written (see `release`)."""

    def __init__(
        self,
        directory: str,
        job: str,
        owner: int,
        world_size: int,
        count: int = OWN_SLOTS,
        access: Access | None = None,
    ) -> None:
        self.dir, self.job, self.owner, self.world_size = directory, job, owner, world_size
        self.count, self.access = count, access or Access.from_env()
        self.access.own_dir(directory)  # a symlink planted in its place is refused
        self._buffers: dict[int, torch.Tensor] = {}
        self._published: dict[int, tuple[int, str]] = {}  # slot -> (step, manifest JSON)
        self._writing: set[int] = set()  # begun, not yet released
        self._lock = threading.Lock()  # a snapshot begins while the last one is published
        self.newest: int | None = None  # the slot holding the newest snapshot
        self.kept: int | None = None  # the newest one the peers hold too (see `keep`)
        self._newest_known = False  # found on first write: verifying slots costs a pass
        self._steps: dict[int, tuple[tuple[int, ...], int | None]] = {}  # see `steps`
        self._seen: dict[int, tuple[int, ...]] | None = None  # see `older`

    def _path(self, slot: int, ext: str) -> str:
        return os.path.join(self.dir, f"slot-{slot}.{ext}")

    def begin(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The slot to overwrite next, invalidated, with a mapped buffer of ``nbytes``: the
        oldest of those neither newest nor being written, preferring slots already mapped
        (a new one costs memory and page faults). It stays taken until `release`."""
        with self._lock:
            if not self._newest_known:
                held = self.whole()
                self.newest = held[max(held)][0] if held else None
                self._newest_known = True
            taken = self._writing | {self.newest, self.kept}
            free = [s for s in range(self.count) if s not in taken]
            if not free:
                raise CheckpointError(f"{self.dir}: every slot is in use; release one first")
            slot = min(free, key=lambda s: (s not in self._buffers, self._step(s), s))
            self._writing.add(slot)
            self._published.pop(slot, None)  # `raw` must not send what is being overwritten
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(slot, "json"))  # from now on this slot is not whole
        current = self._buffers.get(slot)
        if current is None or current.numel() != max(nbytes, 1):
            path = self._path(slot, "bin")
            try:  # a full tmpfs: ENOSPC here, not SIGBUS on the copy (test_exhaustion)
                self.access.size(path, max(nbytes, 1))
            except OSError:
                self.release(slot)
                raise
            current = _mapped(path, max(nbytes, 1))
            self._buffers[slot] = current
        return slot, current

    def _step(self, slot: int) -> int:
        published = self._published.get(slot)
        return -1 if published is None else published[0]

    def release(self, slot: int) -> None:
        """``slot`` is no longer being written or sent: a later `begin` may take it."""
        with self._lock:
            self._writing.discard(slot)

    def keep(self, slot: int) -> None:
        """``slot`` holds the newest snapshot replicated to the peers: keep it until a newer
        one is. A lost node's ranks come back only to a step their peers hold a replica
        of; had the others overwritten their own copy of it, no step in memory would be
        common to every rank, and all would go back to storage."""
        with self._lock:
            self.kept = slot

    def publish(self, slot: int, manifest_json: str, built: Manifest | None = None) -> None:
        """Describe ``slot``: from now on it counts. ``built``: the manifest of
        ``manifest_json`` where this process made it (a peer's is parsed and checked
        here). A manifest received from another slot pair is rewritten to name this
        slot's file."""
        manifest = built or Manifest.from_json(manifest_json.encode(), self.dir, whole=False)
        file = os.path.basename(self._path(slot, "bin"))
        if set(manifest.files) != {file}:
            manifest_json = _renamed(manifest, file)
        tmp = self._path(slot, "json.tmp")
        header = {"job": self.job, "rank": self.owner, "manifest": manifest_json}
        self.access.write_text(tmp, json.dumps(header))
        os.replace(tmp, self._path(slot, "json"))
        with self._lock:
            self._published[slot] = (manifest.step, manifest_json)
            self._newest_known = True
            self.newest = slot

    def raw(self, step: int) -> tuple[str, torch.Tensor]:
        """The manifest JSON and the bytes of the slot holding ``step``, to send. What
        this process published first; a slot's file is read once, as a `begin` on
        another thread may unlink it at any moment."""
        for slot, (held, text) in list(self._published.items()):  # `begin` may pop one
            if held == step:
                return text, self._bytes(slot)
        for slot in range(self.count):
            read = self._read(slot)
            if read is not None and read[0].step == step:
                return read[1], self._bytes(slot)
        raise CheckpointError(f"{self.dir} holds no snapshot of step {step}")

    def _bytes(self, slot: int) -> torch.Tensor:
        buffer = self._buffers.get(slot)
        if buffer is not None:
            return buffer
        path = self._path(slot, "bin")
        return _mapped(path, max(os.lstat(path).st_size, 1))

    def whole(self) -> dict[int, tuple[int, Manifest]]:
        """``{step: (slot, manifest)}`` for every whole slot of this job, rank and world
        size. Their bytes are not checked here: see `intact`."""
        found = {}
        for slot in range(self.count):
            manifest = self._load(slot)
            if manifest is not None:
                found[manifest.step] = (slot, manifest)
        return found

    def steps(self) -> set[int]:
        """The steps of `whole`. A slot's manifest is parsed again only once its files
        changed: a snapshot asks for every copy's (`MemoryTier.free_older`), and parsing
        them all took a rank 2 % of its CPU at a snapshot every 10 steps."""
        return self._steps_of(self._keys())

    def older(self, step: int) -> bool:
        """Whether every snapshot here is older than ``step`` and no slot's files changed
        since the last call: a folder written since is some live rank's, and is not
        looked into (a parse is milliseconds for a few hundred tensors, at each snapshot
        of every rank on the node). The first call judges by the steps alone."""
        keys = self._keys()
        seen, self._seen = self._seen, keys
        if seen is not None and keys != seen:
            return False
        return all(s < step for s in self._steps_of(keys))

    def _steps_of(self, keys: dict[int, tuple[int, ...]]) -> set[int]:
        found = set()
        for slot, key in keys.items():
            known = self._steps.get(slot)
            if known is None or known[0] != key:
                manifest = self._load(slot)
                known = self._steps[slot] = key, None if manifest is None else manifest.step
            if known[1] is not None:
                found.add(known[1])
        return found

    def _keys(self) -> dict[int, tuple[int, ...]]:
        """The files of each slot that has both, as lstat sees them: a slot is rewritten
        by replacing its files, so new inodes."""
        keys: dict[int, tuple[int, ...]] = {}
        for slot in range(self.count):
            try:
                text, data = os.lstat(self._path(slot, "json")), os.lstat(self._path(slot, "bin"))
            except OSError:
                continue
            keys[slot] = (text.st_ino, text.st_mtime_ns, text.st_size, data.st_ino, data.st_size)
        return keys

    def verified(self, step: int) -> Manifest:
        """The manifest of the slot holding ``step``, once every block has matched its
        checksum. `CheckpointError` if no whole slot holds it, `CorruptCheckpointError`
        naming the first damaged tensor."""
        return self.checked(step)[0]

    def checked(self, step: int) -> tuple[Manifest, torch.Tensor]:
        """`verified`, and the slot's bytes that were checked (mapped: no copy)."""
        held = self.whole().get(step)
        if held is None:
            raise CheckpointError(f"{self.dir} holds no snapshot of step {step}")
        slot, manifest = held
        buffer = self._bytes(slot)
        for key, entry in manifest.tensors.items():
            for chunk in entry.chunks:  # every one: an unchecked byte never reaches the state
                view = byte_view(buffer[chunk.start : chunk.end])
                verify_block(view, chunk.xxh3, f"{self._path(slot, 'bin')}: tensor {key!r}")
        return manifest, buffer

    def intact(self, step: int) -> Manifest | None:
        """`verified`, or None (saying why, if the copy is damaged)."""
        try:
            return self.verified(step)
        except CorruptCheckpointError as e:
            log.warning("ignoring %s", e)
            return None
        except CheckpointError:
            return None

    def _load(self, slot: int) -> Manifest | None:
        read = self._read(slot)
        return None if read is None else read[0]

    def _read(self, slot: int) -> tuple[Manifest, str] | None:
        """The manifest of ``slot`` and its JSON, if the slot is whole and this rank's."""
        where = self._path(slot, "json")
        try:
            job, rank, text = snapshot_description(read_own(where))
            manifest = Manifest.from_json(text, where, whole=False)
        except (OSError, ValueError, CheckpointError):  # missing, unreadable, malformed
            return None
        owner = (job, rank, manifest.world_size)
        if owner != (self.job, self.owner, self.world_size):
            log.warning("ignoring %s: it belongs to (job, rank, world) %s", where, owner)
            return None
        data = self._path(slot, "bin")
        try:
            size = os.lstat(data).st_size
        except FileNotFoundError:
            return None
        if size != manifest.files.get(os.path.basename(data)):
            return None
        return manifest, text.decode()


class MemoryTier:
    """The shared-memory snapshots of one rank of one job, and the replicas it keeps for
    its peers."""

    def __init__(
        self, root: str, job: str, rank: int, world_size: int, access: Access | None = None
    ) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self.access = access or Access.from_env()
        self.root = os.path.join(root, folder_name(job))
        private_root(root, self.access)
        self.access.own_dir(self.root)  # only this user's: see `unbroken.access`
        clean_abandoned(root, job)
        own = os.path.join(self.root, f"rank-{rank:05d}")
        self.own = Slots(own, job, rank, world_size, access=self.access)
        self.dir = self.own.dir
        self._replicas: dict[int, Slots] = {}
        self._others: dict[str, Slots] = {}  # folders of other rank numbers, by path
        owner = os.path.join(self.root, f"{contract.OWNER_PREFIX}{rank:05d}")
        self.access.write_text(owner, contract.owner_text(os.getpid()))

    def replica(self, owner: int) -> Slots:
        """The slots holding this rank's replica of rank ``owner``'s snapshots."""
        if owner not in self._replicas:
            self.access.own_dir(os.path.join(self.root, "replicas"))
            directory = os.path.join(self.root, "replicas", f"rank-{owner:05d}")
            # received on the save worker, one at a time, published before the next: two do
            self._replicas[owner] = Slots(
                directory, self.job, owner, self.world_size, count=2, access=self.access
            )
        return self._replicas[owner]

    def copies(self) -> dict[int, list[Slots]]:
        """Every copy of a snapshot this node's memory holds for this job, by the rank
        that saved it (as its slots' headers name it, checked on reading): this rank's
        own, its replicas, and the folders of ranks that had other numbers before the
        job restarted (torchrun may order a replacement node differently, renumbering
        the survivors)."""
        found: dict[int, list[Slots]] = {}
        for kind in ("", "replicas"):
            try:
                names = sorted(os.listdir(os.path.join(self.root, kind)))
            except FileNotFoundError:
                continue
            for name in names:
                owner = rank_of(name)
                if owner is None or owner >= self.world_size:
                    continue
                found.setdefault(owner, []).append(self._slots(kind, name, owner))
        return found

    def _slots(self, kind: str, name: str, owner: int) -> Slots:
        """One `Slots` per folder, so that what one caches (mapped files) stays true."""
        if kind == "replicas":
            return self.replica(owner)
        directory = os.path.join(self.root, name)
        if directory == self.own.dir:
            return self.own
        if directory not in self._others:
            self._others[directory] = Slots(
                directory, self.job, owner, self.world_size, access=self.access
            )
        return self._others[directory]

    def holding(self, owner: int, step: int) -> Slots:
        """Slots that hold a whole snapshot of ``step`` saved by rank ``owner``."""
        for slots in self.copies().get(owner, []):
            if step in slots.steps():
                return slots
        raise CheckpointError(f"{self.root} holds no snapshot of rank {owner} at step {step}")

    def steps_of(self) -> dict[int, list[int]]:
        """``{saved rank: steps}``: the whole snapshots held here, by the rank that
        saved them (not yet checksummed: restore checks only the copies it uses)."""
        held = {o: {s for slots in c for s in slots.steps()} for o, c in self.copies().items()}
        return {o: sorted(steps) for o, steps in held.items() if steps}

    def snapshots(self) -> dict[int, Manifest]:
        """Every whole snapshot this rank holds of itself, by step (not yet checksummed:
        restore checks only the one it chooses, with `Slots.intact`)."""
        return {step: m for step, (_, m) in self.own.whole().items()}

    def free_older(self, step: int) -> list[str]:
        """Remove every other folder of this job whose snapshots are all older than
        ``step``, once ``step`` is complete (every rank holds it, replicas included):
        folders left by ranks renumbered on a restart, replicas of ranks this node no
        longer keeps. No current rank needs them; they would double the memory. A folder
        written since the last call is some live rank's: kept without a look inside."""
        removed = []
        for copies in self.copies().values():
            for slots in copies:
                if slots is self.own or not slots.older(step):
                    continue
                shutil.rmtree(slots.dir, ignore_errors=True)
                self._others.pop(slots.dir, None)
                self._replicas = {o: r for o, r in self._replicas.items() if r is not slots}
                removed.append(slots.dir)
        if removed:
            log.info("freed shared memory no rank needs after step %d: %s", step, removed)
        return removed

    def remove(self) -> None:
        """Forget everything this rank holds (the job finished)."""
        shutil.rmtree(self.own.dir, ignore_errors=True)
        for slots in self._replicas.values():
            shutil.rmtree(slots.dir, ignore_errors=True)


def _mapped(path: str, nbytes: int) -> torch.Tensor:
    """``path`` mapped shared, never through a symlink: the file is opened without
    following one, and mapped through that descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)


def _renamed(manifest: Manifest, file: str) -> str:
    for entry in manifest.tensors.values():
        for chunk in entry.chunks:
            chunk.file = file
    size = sum(manifest.files.values())
    manifest.files = {file: size}
    return manifest.to_json().decode()
