"""Interop with ``torch.distributed.checkpoint`` (DCP): save and load through DCP's own
API and planners, into unbroken's storage backends and checksummed format.

>>> import torch.distributed.checkpoint as dcp
>>> import unbroken.dcp
>>> dcp.save(state, storage_writer=unbroken.dcp.Writer("s3://bucket/run", step=100))
>>> dcp.load(state, storage_reader=unbroken.dcp.Reader("s3://bucket/run"))

A step written this way is an ordinary unbroken checkpoint (``unbroken ls``, ``show``,
``verify`` and ``export`` read it) whose manifest also carries DCP's metadata as JSON:
nothing is pickled by unbroken on save or on load. Bytes items, the non-tensor values DCP's
planner turns into ``torch.save`` bytes, are stored and verified as opaque bytes; DCP's
default load planner unpickles them when it loads them (DCP's behaviour, not unbroken's).

Entry points: convert.
May import: access, errors, format, job, state, storage, tree.
"""

from unbroken.dcp._layout import latest
from unbroken.dcp._reader import Reader
from unbroken.dcp._writer import Writer

__all__ = ["Reader", "Writer", "latest"]
