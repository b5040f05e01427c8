"""Token files: a flat array of uint16 or uint32 token ids, plus a JSON sidecar.

``corpus.bin`` holds the tokens back to back (native little-endian, no header), so any
process can map it with ``numpy.memmap`` and touch only the pages it reads; a process
restarted on the same node maps the same file and finds its pages in the page cache,
with nothing to read or tokenise again. ``corpus.bin.json`` says what the bytes are::

    {"format": "unbroken.tokens", "version": 1, "dtype": "uint16", "tokens": 1234,
     "xxh3_64": "9f2c...", "documents": 3, "tokenizer": "bytes", "eos": 256}

The sidecar is written last, after the tokens are on disk under their final name: a
token file without one is incomplete (like a checkpoint without its manifest).

Checks, and when: opening a file reads the sidecar and compares the file's size with
``tokens`` (a ``stat``: free, and it catches truncation and half-written files).
The checksum covers every byte, so checking it means reading the whole file, which is
what re-attaching avoids; it runs only when asked, `TokenFile.verify` (``unbroken
tokenise --verify``), e.g. once after copying a corpus to a node.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from unbroken.access import Access

FORMAT, VERSION = "unbroken.tokens", 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_HASH_CHUNK = 1 << 24  # 16 MiB per hash update: large enough to run at memory speed


class DataFileError(ValueError):
    """A token file or its sidecar is missing, damaged or unusable; the message names
    the file, what is wrong and what to do."""


def sidecar(path: str | Path) -> Path:
    """Where the sidecar of token file ``path`` lives: ``path`` + ``.json``."""
    return Path(f"{path}.json")


@dataclass(frozen=True)
class TokenFile:
    """One token file, checked against its sidecar and memory-mapped read-only.

    ``tokens`` is a ``numpy.memmap``: slicing it reads only the pages the slice covers
    (from the page cache when another process on the node read them already).
    """

    path: Path
    dtype: str
    count: int
    checksum: str
    meta: dict[str, Any]
    tokens: np.ndarray

    @classmethod
    def open(cls, path: str | Path) -> TokenFile:
        path = Path(path)
        meta = _read_sidecar(path)
        itemsize = np.dtype(DTYPES[meta["dtype"]]).itemsize
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DataFileError(
                f"{path}: no such token file (its sidecar {sidecar(path).name} exists); "
                "write both again with `unbroken tokenise`"
            ) from None
        expected = meta["tokens"] * itemsize
        if size != expected:
            what = "truncated" if size < expected else "longer than its sidecar says"
            raise DataFileError(
                f"{path}: {what}: it holds {size} bytes but its sidecar says "
                f"{meta['tokens']} {meta['dtype']} tokens ({expected} bytes); the copy or "
                "the tokenising did not finish: copy or tokenise it again"
            )
        if meta["tokens"] == 0:
            tokens = np.zeros(0, dtype=DTYPES[meta["dtype"]])
        else:
            tokens = np.memmap(path, dtype=DTYPES[meta["dtype"]], mode="r")
        return cls(path, meta["dtype"], meta["tokens"], meta["xxh3_64"], meta, tokens)

    def verify(self) -> None:
        """Hash every byte and compare with the sidecar's checksum; raise `DataFileError`
        naming the file if they differ. Reads the whole file (from the page cache if it
        is there): seconds per GiB from disk, so not part of `open`."""
        if checksum(self.tokens) != self.checksum:
            raise DataFileError(
                f"{self.path}: checksum mismatch: its bytes changed after it was written "
                f"(sidecar xxh3_64 {self.checksum}); tokenise it again or copy a good one"
            )


def checksum(tokens: np.ndarray) -> str:
    """xxh3_64 of the array's bytes, hashed in 16 MiB pieces (no copy of the whole)."""
    h = xxhash.xxh3_64()
    flat = tokens.reshape(-1).view(np.uint8)
    for start in range(0, len(flat), _HASH_CHUNK):
        h.update(flat[start : start + _HASH_CHUNK].data)
    return h.hexdigest()


def _read_sidecar(path: Path) -> dict[str, Any]:
    side = sidecar(path)
    try:
        meta = json.loads(side.read_text())
    except FileNotFoundError:
        raise DataFileError(
            f"{path}: no sidecar {side.name}: not a finished token file; write it with "
            "`unbroken tokenise` (or unbroken.data.TokenWriter)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataFileError(f"{side}: damaged sidecar, not JSON ({e}); tokenise again") from None
    problem = _sidecar_problem(meta)
    if problem:
        raise DataFileError(f"{side}: bad sidecar: {problem}; tokenise again")
    return meta


def _sidecar_problem(meta: Any) -> str | None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"not an {FORMAT} sidecar"
    if meta.get("version") != VERSION:
        return f"version {meta.get('version')!r}, this unbroken reads version {VERSION}"
    if meta.get("dtype") not in DTYPES:
        return f"dtype {meta.get('dtype')!r} is not one of {sorted(DTYPES)}"
    count = meta.get("tokens")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        return f"token count {count!r} is not a non-negative integer"
    if not isinstance(meta.get("xxh3_64"), str):
        return "no xxh3_64 checksum"
    return None


class TokenWriter:
    """Writes a token file: `append` arrays of ids, then `close` (or leave the ``with``
    block) to fsync it, move it to ``path`` and write the sidecar last.

    ``dtype``: ``"uint16"`` (ids below 65,536) or ``"uint32"``; an id that does not fit
    raises `DataFileError` rather than wrapping around. Until `close`, ``path`` keeps its
    old contents (the tokens go to a temporary file of this process, renamed at the end).
    Both files get `Access.from_env` modes (0600, or 0660 with group access), whatever
    the umask, as everything else unbroken writes.
    """

    def __init__(self, path: str | Path, dtype: str = "uint16", **meta: Any) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        self.path = Path(path)
        self.dtype = dtype
        self.meta = meta
        self.count = 0
        self._hash = xxhash.xxh3_64()
        self._limit = (1 << (8 * np.dtype(DTYPES[dtype]).itemsize)) - 1
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        self._access = Access.from_env()
        fd = self._access.open(str(self._tmp), os.O_WRONLY | os.O_TRUNC)
        self._file = os.fdopen(fd, "wb")  # closed in close()

    def append(self, ids: Any) -> None:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() > self._limit):
            bad = int(arr.max()) if arr.max() > self._limit else int(arr.min())
            self.abort()
            raise DataFileError(
                f"{self.path}: token id {bad} does not fit {self.dtype}; use dtype uint32"
            )
        data = np.ascontiguousarray(arr.astype(DTYPES[self.dtype], copy=False).reshape(-1))
        self._hash.update(data.data)
        self._file.write(data.data)
        self.count += int(data.size)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        side = sidecar(self.path)
        side.unlink(missing_ok=True)  # old tokens stop counting before new ones arrive
        os.replace(self._tmp, self.path)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "tokens": self.count,
            "xxh3_64": self._hash.hexdigest(),
            **self.meta,
        }
        tmp = sidecar(self._tmp)
        self._access.write_text(str(tmp), json.dumps(meta))
        os.replace(tmp, side)

    def abort(self) -> None:
        """Drop what was written; ``path`` is left without tokens or sidecar."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
