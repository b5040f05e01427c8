"""Where a restored step's bytes come from: storage, this node's shared memory, or the
replica of this rank's snapshot that a peer keeps.

Each is a `Source`, used by the restore pipeline in the same three stages:

1. ``open()``: find the step and its manifest (this rank's view of it), checking what
   is cheap to check completely (a snapshot in memory is checksummed here, once, so a
   damaged one can be passed over for another step before anything is read);
2. ``check(manifest, files)``: the files this rank will read are there, whole;
3. ``read(manifest, fills, threads)``: fill each `Fill` region, every block checked
   against its checksum (a snapshot checked on opening is not checked again).

A missing step is a `CheckpointError` naming it; a damaged block a
`CorruptCheckpointError` naming the tensor; a copy that disappears while being read a
`CheckpointError`, never a hang (tests/test_sources.py holds every source to this).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.blockio import run_all
from unbroken.format.directory import Directory
from unbroken.format.layout import Chunk, Manifest, TensorEntry, parse, step_dir, verify_block
from unbroken.format.shards import byte_view, fill_regions, read_held, read_many
from unbroken.job.comm import Comm, brief
from unbroken.memory import replicas
from unbroken.memory.tier import Slots
from unbroken.storage import Storage
from unbroken.storage.local import LocalStorage


@dataclass(frozen=True)
class Origin:
    """Where one rank's state came from: ``"storage"``, its own node's shared
    ``"memory"``, the ``"replica"`` of it that rank ``peer`` kept, or ``"live"``: healed
    at the step the healthy ranks were at, its replicated tensors sent by rank ``peer``
    (None: this rank kept its own live state)."""

    kind: Literal["storage", "memory", "replica", "live"]
    step: int
    peer: int | None = None


@dataclass(frozen=True)
class Restored:
    """What a restore loaded: the step, where each rank's state came from
    (``origins[r]`` for rank r; the same on every rank), and the copies it fell back
    from."""

    step: int
    origins: tuple[Origin, ...]
    rank: int
    damaged: tuple[Origin, ...] = ()  # newer copies passed over: they failed verification

    @property
    def origin(self) -> Origin:
        """This rank's."""
        return self.origins[self.rank]


@dataclass(frozen=True)
class Fill:
    """A region this rank restores: ``region`` (a live tensor, its local shard, or a
    buffer) is the part at ``offsets`` of the saved tensor ``key``, made of the stored
    ``chunks`` that overlap it."""

    key: str
    entry: TensorEntry
    chunks: list[Chunk]
    region: torch.Tensor
    offsets: list[int]
    shared: bool = False  # broadcast to the other ranks once read: never held

    def exact(self) -> Chunk | None:
        """The stored chunk that is exactly this region, if its bytes can land in the
        region as they are (CPU, contiguous, the saved dtype); else None."""
        region = self.region
        if not (
            region.device.type == "cpu"
            and region.is_contiguous()
            and region.dtype == self.entry.torch_dtype
        ):
            return None
        shape = list(region.shape)
        return next(
            (c for c in self.chunks if c.offsets == self.offsets and c.shape == shape), None
        )


class Source(Protocol):
    """Where one rank's bytes of one step come from (see the module's docstring)."""

    @property
    def origin(self) -> Origin: ...

    @property
    def where(self) -> str:
        """Names the copy in messages."""
        ...

    def open(self) -> Manifest:
        """This rank's manifest of the step; `CheckpointError` if the source lacks the
        step. Idempotent: what it checks is checked once."""
        ...

    def check(self, manifest: Manifest, files: set[str]) -> None:
        """Raise `CheckpointError` unless ``files`` (of ``manifest``) can be read whole."""
        ...

    def holds(self, fill: Fill) -> bool:
        """Whether `read` keeps ``fill``'s bytes until the ranks agree, instead of
        writing its region at once."""
        ...

    def read(
        self, manifest: Manifest, fills: Sequence[Fill], threads: int
    ) -> Callable[[], None] | None:
        """Fill every region, or hold its bytes (`holds`) and return what places them;
        `CorruptCheckpointError` naming a tensor that fails its checksum,
        `CheckpointError` if the source disappears meanwhile."""
        ...


class _Files:
    """A step held as files in a `Storage` folder: the layout both a checkpoint on
    storage and a snapshot in memory have (a slot's manifest is an ordinary one)."""

    def __init__(self, storage: Storage, folder: str, where: str, verified: bool) -> None:
        self.storage = storage  # public, so a test can wrap it as it wraps a Checkpointer's
        self.folder = folder
        self.where = where
        self._verified = verified  # every block was checksummed on opening

    def check(self, manifest: Manifest, files: set[str]) -> None:
        """The size of every file, as many at once as the storage takes in flight (a
        rank reading 20 files from S3 waits for one round trip, not 20)."""

        def one(file: str) -> None:
            try:
                size = self.storage.size(f"{self.folder}/{file}")
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{self.where}/{file} is missing; the checkpoint is damaged. Restore an "
                    "earlier step (see `unbroken ls`)"
                ) from None
            if size != manifest.files[file]:
                raise CorruptCheckpointError(
                    f"{self.where}/{file} is {size} bytes but was written with "
                    f"{manifest.files[file]}: it is truncated or damaged. Restore an "
                    "earlier step (see `unbroken ls`)"
                )

        run_all(one, sorted(files), self.storage.requests_in_flight)

    def holds(self, fill: Fill) -> bool:
        """A storage that hands over what it read (S3's responses, a file's pages) keeps
        whole blocks there."""
        return hasattr(self.storage, "read_range") and not fill.shared and bool(fill.exact())

    def read(
        self, manifest: Manifest, fills: Sequence[Fill], threads: int
    ) -> Callable[[], None] | None:
        whole: list[tuple[str, TensorEntry, Chunk, torch.Tensor]] = []
        held: list[tuple[str, TensorEntry, Chunk, torch.Tensor]] = []
        partial = []
        for f in fills:
            chunk = f.exact()
            if chunk is None:
                partial.append(f)
            else:
                (held if self.holds(f) else whole).append((f.key, f.entry, chunk, f.region))
        place = read_held(self.storage, self.folder, held, threads) if held else None
        # Threads overlap one block's checksum (which holds the GIL) with the next
        # block's read (which releases it), and keep several reads in flight.
        verify = not self._verified
        read_many(self.storage, self.folder, whole, threads, verify=verify)
        # Regions cut from other blocks (another number of ranks): planned together, so
        # that neighbouring pieces are fetched in one request.
        targets = [(f.key, f.entry, f.chunks, f.region, f.offsets) for f in partial]
        fill_regions(self.storage, self.folder, targets, threads)
        return place


class StorageSource(_Files):
    """A committed checkpoint in a `Directory`."""

    def __init__(self, directory: Directory, step: int, damage: str | None = None) -> None:
        """``damage``: why the manifest could not be read or failed a rank's checks (see
        `validate`), which opening raises on every rank (`CorruptCheckpointError`)."""
        folder = step_dir(step)
        super().__init__(directory.storage, folder, f"{directory.path}/{folder}", verified=False)
        self.directory, self.step, self._damage = directory, step, damage
        self.origin = Origin("storage", step)
        self._manifest: Manifest | None = None
        self._raw: dict[str, Any] | None = None  # parsed, every part checked (`validate`)
        self._refused: CheckpointError | None = None

    def validate(self, comm: Comm, data: bytes) -> None:
        """Check ``data``, the manifest one rank read (one request for the job), in parts:
        every rank parses it and checks the header and its own part (`parse`), then the
        verdicts are exchanged, so that a part damaged anywhere makes the step damaged
        on every rank, with what its rank found. Opening then builds the manifest, not
        checking it again. Collective."""
        verdict, part = None, (comm.rank, comm.world_size)
        try:
            self._raw = parse(data, self.directory.manifest_path(self.step), part)
        except CorruptCheckpointError as e:
            verdict = str(e)
        except CheckpointError as e:  # a newer format: the header's, the same on every rank
            self._refused = e
        damage = next((v for v in comm.all_gather(verdict) if v is not None), None)
        if damage is not None:
            self._damage, self._raw = damage, None

    def open(self) -> Manifest:
        if self._damage is not None:
            raise CorruptCheckpointError(self._damage)
        if self._refused is not None:
            raise self._refused
        if self._manifest is None:
            if self._raw is None:  # not validated by the ranks together: here, whole
                data = self.directory.manifest_bytes(self.step)
                self._manifest = self.directory.parse(self.step, data)
            else:
                self._manifest = self.directory.built(self.step, self._raw)
        return self._manifest


class MemorySource(_Files):
    """This rank's own snapshot in this node's shared memory. Opening it checksums every
    block (memory is read faster than hashed, and a damaged snapshot must be found
    before the ranks agree to use it); reading does not check them again."""

    def __init__(self, slots: Slots, step: int) -> None:
        # The slot pair's folder under its parent, so messages name the rank's folder.
        parent, folder = os.path.split(slots.dir)
        where = f"shared memory {slots.dir} (step {step})"
        super().__init__(LocalStorage(parent), folder, where, verified=True)
        self.slots, self.step = slots, step
        self.origin = Origin("memory", step)
        self._manifest: Manifest | None = None
        self._bytes = torch.empty(0, dtype=torch.uint8)  # the slot's, once opened

    def open(self) -> Manifest:
        if self._manifest is None:
            self._manifest, self._bytes = self.slots.checked(self.step)
        return self._manifest

    def check(self, manifest: Manifest, files: set[str]) -> None:
        """Nothing left to check: opening checked every block, in pages that stay mapped."""

    def read(
        self, manifest: Manifest, fills: Sequence[Fill], threads: int
    ) -> Callable[[], None] | None:
        """Whole blocks stay in the slot, checked on opening and mapped already, until
        ``place()`` copies them into the live tensors; parts of blocks are read as files.
        Nothing writes the slot meanwhile: only this rank's `snapshot` writes its own
        slots, and a snapshot's replicas arrive only in a replication every rank joins."""
        whole = [(f, chunk) for f in fills if self.holds(f) and (chunk := f.exact())]
        super().read(manifest, [f for f in fills if not self.holds(f)], threads)
        data = self._bytes

        def place() -> None:
            for f, chunk in whole:
                byte_view(f.region)[:] = byte_view(data[chunk.start : chunk.end])

        return place


class ReplicaSource:
    """This rank's snapshot, kept by rank ``provider`` as a replica, arriving over the
    checkpointer's group block by block, straight into the live tensors where their
    layout allows. ``manifest`` is the JSON the provider published (see
    `replicas.manifests`); the provider checked its copy, and every block is checked
    again on arrival."""

    def __init__(self, comm: Comm, provider: int, step: int, manifest: str) -> None:
        self.comm, self.provider, self.step = comm, provider, step
        self.origin = Origin("replica", step, provider)
        self.where = f"the replica on rank {provider} (step {step})"
        self._text = manifest
        self._manifest: Manifest | None = None

    def open(self) -> Manifest:
        if self._manifest is None:
            manifest = Manifest.from_json(self._text.encode(), self.where, whole=False)
            if manifest.step != self.step:
                raise CheckpointError(f"{self.where} holds step {manifest.step}")
            self._manifest = manifest
        return self._manifest

    def check(self, manifest: Manifest, files: set[str]) -> None:
        """Nothing to check before the transfer: the provider checked its copy."""

    def holds(self, fill: Fill) -> bool:
        return False

    def read(self, manifest: Manifest, fills: Sequence[Fill], threads: int) -> None:
        arriving = []  # (key, chunk, where it lands, the region it is for)
        for f in fills:
            chunk = f.exact()
            if chunk is not None:
                arriving.append((f.key, chunk, f.region, f.region))
                continue
            chunk = f.chunks[0]
            if chunk.shape != list(f.region.shape):
                raise CheckpointError(
                    f"the replica on rank {self.provider}: tensor {f.key!r} has shape "
                    f"{chunk.shape}, this rank's is {list(f.region.shape)}"
                )
            buffer = torch.empty(chunk.shape, dtype=f.entry.torch_dtype)
            arriving.append((f.key, chunk, buffer, f.region))
        into = {key: data.reshape(-1).view(torch.uint8) for key, _, data, _ in arriving}
        try:
            replicas.receive(self.comm, manifest, self.provider, into).wait()
        except RuntimeError as e:  # gloo: the provider died, or the transfer timed out
            raise CheckpointError(  # a lost peer: `Comm.wire` around the restore says so
                f"{self.where} disappeared during the transfer ({brief(e)}): its provider failed; "
                "restore again (from storage if the replica is gone)"
            ) from e
        for key, chunk, data, region in arriving:
            what = f"the replica on rank {self.provider}: tensor {key!r}"
            verify_block(byte_view(data), chunk.xxh3, what, " on arrival")
            if data is not region:
                region.copy_(data)
