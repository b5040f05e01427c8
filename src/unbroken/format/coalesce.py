"""Turning the byte ranges a restore needs into read requests, and issuing them: the one
planner every block read goes through (`unbroken.format.shards`: whole blocks, and the parts of
blocks a reshard needs; the DCP reader and offline tools through it).

A request costs a round trip whatever its size, tens of ms on some object stores, so
neighbouring ranges of one file are merged into runs (small gaps read and dropped), and
a rank's reads all go to one set of workers, as deep as the storage serves requests at
once, so every connection stays busy to the end. The `Rules` say how far to merge:

- on an object store (`rules_for`: a storage with many requests in flight and a part
  size), runs cross tensor boundaries and are cut into requests of at most the part
  size, and smaller when the whole read would not otherwise give every connection
  `WAVES` of them (the connections that finish first take the rest, so none idles
  while a slow one ends the read), but never smaller than the storage measured a
  request must be to be worth its round trip (`unbroken.storage.pacing`; `MIN_PIECE`
  until it has measured). The cuts fall on a grid of the request size (a power of two)
  in the file's offsets, not where a run happens to start: RGW, which keeps an object
  in 4 MiB RADOS objects, served such GETs measurably faster than the same GETs shifted
  by a shard file's header, or cut at the upload's part boundaries;
- elsewhere (local files), only runs of small ranges are merged: a large block is read
  alone, straight into its destination, which a file system serves as fast.

Each range is handed on (checked, placed) as soon as its last byte is in, in the worker
that read that byte, so checksums overlap the reads still in flight.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from unbroken.format.blockio import read_into, read_range, read_scatter, run_all
from unbroken.storage import Storage

GAP_BYTES = 256 << 10  # object stores: bytes between two ranges read and dropped
# Object stores: requests are never smaller than this before the storage has measured its
# round trips. On a server with a few ms per request (moto here, 7 ms for 4 KiB) a 1 MiB
# request spends as long waiting as moving bytes.
MIN_PIECE = 8 << 20
FLOOR_PIECE = 1 << 20  # nor than this after: each request costs CPU at both ends
WAVES = 2  # requests per connection, where the read is large enough to give them
SLIVER = 8  # an end piece of a run under 1/SLIVER of a request joins its neighbour
# Local files: ranges under SMALL_BYTES join their neighbours, up to GROUP_BYTES a request.
SMALL_BYTES = 1 << 20
GROUP_BYTES = 16 << 20


@dataclass(frozen=True)
class Rules:
    """How far to merge: ranges at most ``gap`` bytes apart share a request; only ranges
    under ``small`` bytes join others (None: any); a request spans at most ``most`` bytes.
    ``split``: runs (and ranges) are cut at the file's multiples of ``most`` (`_bounds`);
    otherwise a range over ``most`` bytes is read whole, alone."""

    gap: int
    small: int | None
    most: int
    split: bool


@dataclass(frozen=True)
class Extent:
    """Bytes [start, end) of ``file`` to read, for ``key`` (named in errors)."""

    key: str
    file: str
    start: int
    end: int


@dataclass
class Request:
    """One read: bytes [start, end) of ``file``; ``parts`` are ``(extent index, lo, hi)``:
    bytes [lo, hi) of that extent (relative to its start) are in this request."""

    file: str
    start: int
    end: int
    parts: list[tuple[int, int, int]] = field(default_factory=list)


def plan(extents: Sequence[Extent], rules: Rules) -> list[Request]:
    """The requests that read every byte of every extent exactly once, following
    ``rules``, in file order (an empty extent is in none)."""
    order = sorted(
        (i for i, e in enumerate(extents) if e.end > e.start),
        key=lambda i: (extents[i].file, extents[i].start),
    )
    runs: list[list[int]] = []
    for i in order:
        e = extents[i]
        if runs and _joins(extents, runs[-1], e, rules):
            runs[-1].append(i)
        else:
            runs.append([i])
    requests: list[Request] = []
    for run in runs:
        start, end = extents[run[0]].start, max(extents[i].end for i in run)
        bounds = _bounds(start, end, rules)
        file = extents[run[0]].file
        cuts = [Request(file, a, b) for a, b in itertools.pairwise(bounds)]
        for i in run:
            e = extents[i]
            for cut in cuts[bisect.bisect_right(bounds, e.start) - 1 :]:
                if cut.start >= e.end:
                    break
                lo, hi = max(cut.start, e.start), min(cut.end, e.end)
                cut.parts.append((i, lo - e.start, hi - e.start))
        for cut in cuts:  # trimmed to the bytes its parts need
            if cut.parts:
                cut.start = min(extents[i].start + lo for i, lo, _ in cut.parts)
                cut.end = max(extents[i].start + hi for i, _, hi in cut.parts)
                requests.append(cut)
    return requests


def _bounds(start: int, end: int, rules: Rules) -> list[int]:
    """Where a run of bytes [start, end) is cut: split, at the file's multiples of
    ``most``, but an end piece under 1/`SLIVER` of that joins its neighbour instead of
    costing a request of its own (the bytes a shard file's header pushes past the last
    line); otherwise nowhere."""
    if not rules.split:
        return [start, end]
    step = rules.most
    inner = list(range(start // step * step + step, end, step))
    if inner and inner[0] - start < step // SLIVER:
        inner.pop(0)
    if inner and end - inner[-1] < step // SLIVER:
        inner.pop()
    return [start, *inner, end]


def _joins(extents: Sequence[Extent], run: list[int], e: Extent, rules: Rules) -> bool:
    first, last = extents[run[0]], extents[run[-1]]
    if last.file != e.file or not 0 <= e.start - last.end <= rules.gap:
        return False
    small = rules.small
    if small is not None and (e.end - e.start >= small or last.end - last.start >= small):
        return False
    return rules.split or e.end - first.start <= rules.most


def rules_for(storage: Storage, total: int, threads: int) -> Rules:
    """The rules that suit ``storage`` for reading ``total`` bytes with ``threads``."""
    part_size = getattr(storage, "part_size", None)
    in_flight = max(threads, storage.requests_in_flight)
    if storage.requests_in_flight > 1 and part_size:
        measured = getattr(storage, "smallest_request", None)
        smallest = MIN_PIECE if measured is None else max(FLOOR_PIECE, measured)
        # WAVES requests per connection (one request for 16 MiB would leave 15 idle),
        # in powers of two, so that the grid of requests meets the server's (see above)
        least = 1 << (smallest - 1).bit_length()
        even = max(1, total // (WAVES * max(1, in_flight)))
        piece = min(part_size, max(least, 1 << (even.bit_length() - 1)))
        return Rules(gap=GAP_BYTES, small=None, most=piece, split=True)
    return Rules(gap=0, small=SMALL_BYTES, most=GROUP_BYTES, split=False)


# (extent index, its bytes): called once per extent, once all of them are in
Done = Callable[[int, memoryview], None]


def fetch(
    storage: Storage, folder: str, extents: Sequence[Extent],
    into: Sequence[memoryview | None], done: Done, threads: int, rules: Rules | None = None,
) -> None:  # fmt: skip
    """Read every extent of ``folder``'s files and call ``done(index, bytes)`` for it as
    soon as all its bytes are in. ``into[i]`` is where extent i's bytes go (its length),
    or None: then ``done`` gets them in a buffer that is valid only during the call (no
    copy when the extent is read in one request). Returns once every call has returned;
    raises the first error any read or ``done`` raised (the others still finish)."""
    total = sum(e.end - e.start for e in extents)
    in_flight = max(1, threads, storage.requests_in_flight)
    requests = plan(extents, rules or rules_for(storage, total, in_flight))
    length = [e.end - e.start for e in extents]
    remaining = Counter(i for request in requests for i, _, _ in request.parts)
    buffers: dict[int, memoryview] = {}  # extents with no ``into`` read in several requests
    lock = threading.Lock()

    def target(i: int) -> memoryview:
        view = into[i]
        if view is not None:
            return view
        with lock:
            if i not in buffers:
                buffers[i] = memoryview(bytearray(length[i]))
            return buffers[i]

    def landed(i: int, data: memoryview | None) -> None:
        with lock:
            remaining[i] -= 1
            if remaining[i]:
                return
            if data is None:
                view = into[i]
                data = view if view is not None else buffers.pop(i)
        done(i, data)

    def get(request: Request) -> None:
        key, (first, lo, hi) = extents[request.parts[0][0]].key, request.parts[0]
        if all(into[i] is not None for i, _, _ in request.parts) or (
            len(request.parts) == 1 and (lo, hi) != (0, length[first])
        ):  # every part straight into its own memory
            parts = [(extents[i].start + lo, target(i)[lo:hi]) for i, lo, hi in request.parts]
            read_scatter(storage, folder, key, request.file, parts)
            for i, _, _ in request.parts:
                landed(i, None)
            return
        data = memoryview(bytearray(request.end - request.start))
        read_into(storage, folder, key, request.file, request.start, data)
        for i, lo, hi in request.parts:
            at = extents[i].start + lo - request.start
            if into[i] is None and (lo, hi) == (0, length[i]):
                landed(i, data[at : at + hi - lo])  # whole in this request: no copy
            else:
                target(i)[lo:hi] = data[at : at + hi - lo]
                landed(i, None)

    for i, view in enumerate(into):
        if not length[i]:  # nothing to read: handed on as it is
            done(i, view if view is not None else memoryview(b""))
    run_all(get, requests, in_flight)


# (extent index, its bytes: slices of the storage's response buffers, in order)
Held = Callable[[int, list[memoryview]], None]


def fetch_held(
    storage: Storage, folder: str, extents: Sequence[Extent], done: Held, threads: int
) -> None:
    """`fetch` for a storage that hands over the buffers its responses arrive in
    (``read_range``): nothing is copied, and ``done(i, pieces)`` gets extent i's bytes as
    slices of those buffers, in order, as soon as the last is in. They stay valid for as
    long as the caller keeps them."""
    total = sum(e.end - e.start for e in extents)
    in_flight = max(1, threads, storage.requests_in_flight)
    requests = plan(extents, rules_for(storage, total, in_flight))
    remaining = Counter(i for request in requests for i, _, _ in request.parts)
    pieces: dict[int, dict[int, memoryview]] = {}
    lock = threading.Lock()

    def get(request: Request) -> None:
        key = extents[request.parts[0][0]].key
        data = read_range(
            storage, folder, key, request.file, request.start, request.end - request.start
        )
        for i, lo, hi in request.parts:
            at = extents[i].start + lo - request.start
            with lock:
                pieces.setdefault(i, {})[lo] = data[at : at + hi - lo]
                remaining[i] -= 1
                whole = [] if remaining[i] else [v for _, v in sorted(pieces.pop(i).items())]
            if whole:
                done(i, whole)

    for i, e in enumerate(extents):
        if e.end == e.start:
            done(i, [])
    run_all(get, requests, in_flight)
