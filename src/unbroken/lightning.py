"""PyTorch Lightning: `CheckpointIO`, a Trainer plugin that keeps Lightning's checkpoints in
unbroken's format, on local disk or object storage, saved in the foreground or background.

>>> trainer = Trainer(plugins=[unbroken.lightning.CheckpointIO(async_save=True)])

Each path Lightning names (``epoch=3-step=400.ckpt``, ``last.ckpt``) becomes an unbroken
checkpoint directory. A save commits a new step in it and only then deletes the older
one, so replacing ``last.ckpt`` is atomic: a reader finds the old checkpoint or the new
one, never half of either. Lightning calls save and remove on global rank 0 alone and
load on every rank, so none of them is collective here (unlike `Checkpointer`).

Tensors are stored checksummed; everything else (loop state, callbacks' state,
hyper-parameters) as JSON. A value JSON cannot hold is refused, naming its key, unless
``allow_pickle=True``: loading then unpickles it, which runs code from the checkpoint.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import sys
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from unbroken.errors import CheckpointError
from unbroken.format.directory import Directory
from unbroken.format.offline import read_all
from unbroken.job.background import SaveThread, wait_for
from unbroken.job.comm import Comm
from unbroken.retention import KeepLast
from unbroken.saving import pipeline as saving
from unbroken.saving.committed import Collector
from unbroken.saving.staging import Stager
from unbroken.storage import open_storage
from unbroken.tree import decode

try:
    from lightning_fabric.plugins.io import CheckpointIO as _Base
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(f"unbroken.lightning needs `pip install 'unbroken[lightning]'` ({e})") from e

log = logging.getLogger("unbroken")

_PICKLED = "unbroken.pickled"  # top-level entry holding pickled values, as uint8 tensors
_MARK = "__unbroken_pickle__"  # stands in the tree where a pickled value was


class _Solo(Comm):
    """The coordination of a single process, even under torch.distributed: Lightning
    saves on rank 0 alone and loads on every rank independently."""

    def __init__(self) -> None:
        self.group = None
        self.rank, self.world_size = 0, 1


class CheckpointIO(_Base):
    """Lightning's checkpoints through unbroken: ``Trainer(plugins=[CheckpointIO()])``.

    Works with ``ModelCheckpoint`` (``save_top_k``, ``monitor``, ``save_last``) and with
    ``trainer.fit(ckpt_path=...)``; paths may be local or ``s3://bucket/prefix/...``.

    Args:
        async_save: return from a save once the checkpoint is copied into host memory
            (one buffer, reused), and write it in the background. Unlike Lightning's
            ``AsyncCheckpointIO``, which clones every tensor on its device first, this
            never holds a second copy in device memory. A failed background save is
            raised by the next save, load, remove or teardown.
        storage_options: for ``s3://`` paths, the fields of
            `unbroken.storage.s3.S3Options` (endpoint, region, credentials...).
        allow_pickle: store values JSON cannot hold by pickling them, and unpickle them
            on load. Off by default: such a value is an error naming its key, and a
            checkpoint holding one loads only with this on.
        io_threads: parallel readers, and writers of a foreground save (a background
            save hashes and writes on one thread: a core at most, beside the loop).
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        io_threads: int = 2,
    ) -> None:
        super().__init__()
        _register_with_lightning()
        self.async_save = async_save
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.io_threads = io_threads
        self._stager = Stager(1)
        self._worker: SaveThread | None = None
        self._pending: list[Future[None]] = []

    # -- the CheckpointIO interface ----------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as ``path``: committed on return, or, with ``async_save``,
        staged in host memory (the caller may change every tensor at once)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes storage_options in its constructor")
        self._raise_failures(wait=False)
        path = os.fspath(path)
        state = _storable(checkpoint, self.allow_pickle)
        if not self.async_save:
            self._persist(path, saving.stage(0, state, arena=None), self.io_threads)
            return
        arena = self._stager.acquire(wait=True)
        assert arena is not None  # waited for one
        try:
            staged = saving.stage(0, state, arena)
        except BaseException:
            self._stager.release(arena)
            raise
        if self._worker is None:
            self._worker = SaveThread()
        # A background save takes a core at most, as `Checkpointer.save`'s: the loop runs on.
        self._pending.append(self._worker.submit(self._persist, path, staged, 1))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint saved as ``path``, its tensors on the CPU (or ``map_location``),
        every byte checked against its checksum. ``weights_only`` is accepted for
        Lightning's sake: nothing is unpickled unless ``allow_pickle`` says so."""
        self._raise_failures(wait=True)
        path = os.fspath(path)
        if "://" not in path and os.path.isfile(path):
            raise CheckpointError(
                f"{path} is a file, not an unbroken checkpoint (a directory): another "
                "CheckpointIO wrote it (Lightning's default: torch.save); load it with that one"
            )
        if "://" not in path and not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint {path} not found")
        directory = self._directory(path)
        manifest = directory.manifest()
        tensors = read_all(directory, manifest, list(manifest.tensors), self.io_threads)
        if map_location is not None:
            tensors = {key: _locate(t, map_location) for key, t in tensors.items()}
        tree = manifest.objects_for(0)
        checkpoint = {name: decode(value, tensors) for name, value in tree.items()}
        pickled = checkpoint.pop(_PICKLED, [])
        loaded: dict[str, Any] = _unpickled(checkpoint, pickled, self.allow_pickle, path)
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint ``path`` (a link to one: the link only)."""
        self._raise_failures(wait=True)
        path = os.fspath(path)
        if "://" not in path:
            if os.path.islink(path) or os.path.isfile(path):
                os.unlink(path)
            elif os.path.isdir(path):
                shutil.rmtree(path)
            return
        directory = self._directory(path)
        for step in directory.steps():  # manifests first: no reader sees half a checkpoint
            directory.delete(step)
        parent, _, name = path.rstrip("/").rpartition("/")
        open_storage(parent, self.storage_options).delete(name)

    def exists(self, path: Any) -> bool:
        """Whether ``path`` holds a committed checkpoint (to resume from it or not)."""
        self._raise_failures(wait=True)
        path = os.fspath(path)
        if "://" not in path and not os.path.isdir(path):
            return False
        return self._directory(path).latest() is not None

    def teardown(self) -> None:
        """Wait for background saves; raise the first that failed."""
        self._raise_failures(wait=True)

    # -- internals ---------------------------------------------------------------------

    def _directory(self, path: str) -> Directory:
        return Directory(open_storage(path, self.storage_options), path)

    def _persist(self, path: str, staged: saving.Staged, threads: int) -> None:
        """Commit ``staged`` as the next step of ``path`` on ``threads`` IO threads, then
        delete the older steps."""
        try:
            directory = self._directory(path)
            latest = directory.latest()
            staged.step = 0 if latest is None else latest + 1
            collector = Collector(directory, KeepLast(1), active=True)
            context = saving.SaveContext(
                comm=_Solo(), directory=directory, io_threads=threads, collector=collector
            )
            try:
                saving.persist(context, staged)
            finally:
                collector.close()
        finally:
            if staged.arena is not None:
                self._stager.release(staged.arena)

    def _raise_failures(self, wait: bool) -> None:
        """Forget finished background saves, raising the first failure among them; with
        ``wait``, wait for all of them first."""
        if wait:
            wait_for(self._pending, "waiting for background checkpoint saves")
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            if (error := future.exception()) is not None:
                raise CheckpointError(f"a background checkpoint save failed: {error}") from error


def checkpoint_file(path: str | os.PathLike[str], allow_pickle: bool = False) -> io.BytesIO:
    """The checkpoint saved as ``path`` as the file Lightning's classmethods read:

    >>> model = MyModule.load_from_checkpoint(unbroken.lightning.checkpoint_file("last.ckpt"))

    ``load_from_checkpoint`` does not go through the Trainer's plugins: given the path
    itself, it reads a directory with `torch.load` and fails with ``IsADirectoryError``. This
    reads it with `CheckpointIO` (every byte checked) and hands Lightning the same dict
    as a ``torch.save`` stream, which its ``weights_only`` load accepts."""
    checkpoint = CheckpointIO(allow_pickle=allow_pickle).load_checkpoint(path)
    stream = io.BytesIO()
    torch.save(checkpoint, stream)
    stream.seek(0)
    return stream


def _locate(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    """``t`` where ``torch.load(map_location=...)`` would put it."""
    if callable(map_location):
        moved = map_location(t, "cpu")
        return t if moved is None else moved
    if isinstance(map_location, Mapping):
        return t.to(map_location.get("cpu", "cpu"))
    return t.to(map_location)


def _storable(checkpoint: Mapping[str, Any], allow_pickle: bool) -> dict[str, Any]:
    """``checkpoint`` with every value that is neither a tensor nor JSON pickled (into
    the ``_PICKLED`` entry, a marker in its place) or, without ``allow_pickle``, refused."""
    pickled: list[torch.Tensor] = []

    def plain(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor) or value is None:
            return value
        if isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, tuple | list):
            items = [plain(v, f"{path}/{i}") for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, Mapping) and all(
            k is None or isinstance(k, str | int | bool) for k in value
        ):
            if _MARK in value:
                raise CheckpointError(f"checkpoint key {path}/{_MARK} is reserved by unbroken")
            return {k: plain(v, f"{path}/{k}") for k, v in value.items()}
        what = f"{type(value).__module__}.{type(value).__qualname__}"
        if not allow_pickle:
            raise CheckpointError(
                f"checkpoint key {path!r} holds a {what}, which only pickle can store, and "
                "loading a pickle runs code. Make it a tensor or JSON value (numbers, "
                "strings, lists, dicts), or pass CheckpointIO(allow_pickle=True) if you "
                "trust everyone who writes these checkpoints"
            )
        pickled.append(torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8))
        return {_MARK: len(pickled) - 1}

    out = {name: plain(value, name) for name, value in checkpoint.items()}
    if pickled:
        out[_PICKLED] = pickled
    return out


def _unpickled(
    value: Any, pickled: list[torch.Tensor], allow: bool, path: str, key: str = ""
) -> Any:
    """``value`` with the markers `_storable` left replaced by what they stand for."""
    if isinstance(value, dict):
        if set(value) == {_MARK}:
            if not allow:
                raise CheckpointError(
                    f"{path}: checkpoint key {key!r} was stored with pickle, and unpickling "
                    "runs code from the checkpoint; pass CheckpointIO(allow_pickle=True) "
                    "only if you trust whoever wrote it"
                )
            return pickle.loads(pickled[value[_MARK]].numpy().tobytes())
        return {k: _unpickled(v, pickled, allow, path, _join(key, k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_unpickled(v, pickled, allow, path, _join(key, i)) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _join(key: str, part: object) -> str:
    return f"{key}/{part}" if key else str(part)


def _register_with_lightning() -> None:
    """Make `CheckpointIO` pass the plugin checks of the ``lightning`` package too, whose
    classes are distinct from ``pytorch_lightning``'s, when the job has imported it."""
    module = sys.modules.get("lightning.fabric.plugins.io")
    base = getattr(module, "CheckpointIO", None)
    if base is not None and not issubclass(CheckpointIO, base):
        base.register(CheckpointIO)
