"""Tokenise a corpus once into a token file (`unbroken tokenise`).

Inputs, by extension: ``.txt`` (a whole file is one document), ``.jsonl`` (one JSON
object per line, the text under ``field``), ``.parquet`` and ``.arrow`` (the column
``field``; these need pyarrow: ``pip install 'unbroken[data]'``). Documents are tokenised
one at a time, in input order, with ``eos`` after each, and streamed to the file: memory
stays flat whatever the corpus size.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.data.files import DataFileError, TokenWriter

Tokenizer = Callable[[str], Sequence[int]]
_BATCH_TOKENS = 1 << 20  # ids buffered before each write


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, with 256 as end of document: no vocabulary to
    download, and every text round-trips."""

    name = "bytes"
    vocab_size = 257
    eos = 256

    def __call__(self, text: str) -> Sequence[int]:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)  # type: ignore[return-value]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def as_tokenizer(tokenizer: Any) -> Tokenizer:
    """A text -> ids callable from a callable, or from an object whose ``encode``
    returns ids or something with ``.ids`` (a Hugging Face ``tokenizers.Tokenizer``)."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None or isinstance(tokenizer, ByteTokenizer):
        if not callable(tokenizer):
            raise TypeError(f"{tokenizer!r} is neither callable nor has an encode method")
        return tokenizer

    def call(text: str) -> Sequence[int]:
        out = encode(text)
        return getattr(out, "ids", out)

    return call


def load_tokenizer(spec: str) -> Any:
    """``"bytes"``, or the path of a Hugging Face ``tokenizer.json`` (read locally,
    nothing downloaded; needs the ``tokenizers`` package)."""
    if spec == "bytes":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise DataFileError(f"tokenizer {spec}: no such file; pass 'bytes' or a tokenizer.json")
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise DataFileError(
            f"tokenizer {spec}: reading tokenizer.json needs `pip install tokenizers`"
        ) from None
    return HFTokenizer.from_file(spec)


def documents(path: str | Path, field: str = "text") -> Iterator[str]:
    """The documents of one input file, by its extension (see the module docstring)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl(path, field)
    elif suffix in (".parquet", ".arrow"):
        yield from _arrow(path, field)
    else:
        yield path.read_text(encoding="utf-8")


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[field]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataFileError(
                    f"{path}, line {number}: not a JSON object with a {field!r} string; "
                    "fix the line or pass --field"
                ) from None
            if not isinstance(text, str):
                raise DataFileError(f"{path}, line {number}: {field!r} is not a string")
            yield text


def _arrow(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataFileError(
            f"{path}: reading Parquet/Arrow needs pyarrow: pip install 'unbroken[data]'"
        ) from None
    if path.suffix.lower() == ".parquet":
        reader = pyarrow.parquet.ParquetFile(path)
        if field not in reader.schema_arrow.names:
            raise DataFileError(f"{path}: no column {field!r}; pass --field")
        batches: Iterable[Any] = reader.iter_batches(columns=[field])
    else:
        with pyarrow.memory_map(str(path)) as source:
            table = pyarrow.ipc.open_file(source).read_all()
        if field not in table.column_names:
            raise DataFileError(f"{path}: no column {field!r}; pass --field")
        batches = table.select([field]).to_batches()
    for batch in batches:
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


@dataclass(frozen=True)
class Tokenised:
    """What `tokenise` wrote."""

    path: Path
    tokens: int
    documents: int
    seconds: float


def tokenise(
    inputs: Sequence[str | Path],
    out: str | Path,
    tokenizer: Any = None,
    *,
    field: str = "text",
    eos: int | None = None,
    dtype: str | None = None,
) -> Tokenised:
    """Tokenise every document of ``inputs`` into the token file ``out`` (+ sidecar).

    ``tokenizer``: any text -> ids callable, or a Hugging Face ``tokenizers.Tokenizer``;
    default `ByteTokenizer`. ``eos``: the id appended after each document (default:
    the tokenizer's ``eos`` attribute, else none). ``dtype``: default uint16 when the
    tokenizer's vocabulary fits (``vocab_size`` or ``get_vocab_size()``), else uint32.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    encode = as_tokenizer(tokenizer)
    eos = getattr(tokenizer, "eos", None) if eos is None else eos
    dtype = dtype or _dtype_for(tokenizer)
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    started = time.perf_counter()
    count = 0
    with TokenWriter(out, dtype, documents=0, tokenizer=name, eos=eos) as writer:
        pending: list[np.ndarray] = []
        size = 0
        for path in inputs:
            for text in documents(path, field):
                ids = np.asarray(encode(text), dtype=np.int64)
                pending.append(ids if eos is None else np.append(ids, eos))
                size += len(pending[-1])
                count += 1
                if size >= _BATCH_TOKENS:
                    writer.append(np.concatenate(pending))
                    pending, size = [], 0
        if pending:
            writer.append(np.concatenate(pending))
        writer.meta["documents"] = count
    return Tokenised(Path(out), writer.count, count, time.perf_counter() - started)


def _dtype_for(tokenizer: Any) -> str:
    size = getattr(tokenizer, "vocab_size", None)
    if size is None and callable(getattr(tokenizer, "get_vocab_size", None)):
        size = tokenizer.get_vocab_size()
    return "uint16" if isinstance(size, int) and size <= 1 << 16 else "uint32"
