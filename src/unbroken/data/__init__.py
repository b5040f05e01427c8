"""Training data that survives restarts: memory-mapped token files and an exactly
resumable distributed order.

- `TokenDataset`: fixed-length samples from token files (flat uint16/uint32 ids plus a
  JSON sidecar), memory-mapped, so a restarted process re-attaches through the page cache.
- `ResumableSampler`: the batches of this rank, shuffled per epoch from a seed; its state
  (epoch, global position) resumes at the very next batch, on any number of ranks.
- `ResumableLoader`: a ``DataLoader`` with workers as a `Stateful` whose position counts
  only the batches the loop received (not those prefetched).
- `tokenise`: a corpus (text, JSONL, Parquet/Arrow) into a token file, once
  (``unbroken tokenise``).

Entry points: command, files, tokenise.
May import: access (the modes of the token files it writes).
"""

from unbroken.data.dataset import TokenDataset
from unbroken.data.files import DataFileError, TokenFile, TokenWriter
from unbroken.data.sampler import ResumableLoader, ResumableSampler
from unbroken.data.tokenise import ByteTokenizer, tokenise

__all__ = [
    "ByteTokenizer",
    "DataFileError",
    "ResumableLoader",
    "ResumableSampler",
    "TokenDataset",
    "TokenFile",
    "TokenWriter",
    "tokenise",
]
