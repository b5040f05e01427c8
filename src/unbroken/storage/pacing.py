"""How large an object-store read must be to spend most of its time moving bytes.

Every request pays a round trip whatever its size: about 1 ms to a server on this
machine, tens of ms to a cloud store. A request of ``s`` bytes on a connection that moves
``B`` bytes a second (with the other connections busy too) takes ``L + s / B``: it spends
at least `SHARE` of that moving bytes once ``s >= SHARE / (1 - SHARE) * L * B``.
`Pacing` measures ``L`` from small requests (a HEAD, a manifest's GET) and ``L + s / B``
from large ones, and gives that size: the median over recent large requests. The reader
that asks (`unbroken.format.coalesce.rules_for`) still bounds it by the part size, and cuts
smaller requests only where there would not otherwise be two for every connection.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

SHARE = 0.9  # of a request's time spent moving bytes, at least
SMALL = 64 << 10  # a request of at most this many bytes measures the round trip
LARGE = 1 << 20  # one of at least this many measures what a connection moves
RECENT = 32  # requests of each kind remembered


class Pacing:
    """Request times, recorded by a storage as its requests complete (thread-safe)."""

    def __init__(self) -> None:
        self._round_trips: deque[float] = deque(maxlen=RECENT)
        self._sizes: deque[float] = deque(maxlen=RECENT)
        self._lock = threading.Lock()

    def record(self, nbytes: int, seconds: float) -> None:
        """A request that moved ``nbytes`` took ``seconds``, from sending to the last byte."""
        with self._lock:
            if nbytes <= SMALL:
                self._round_trips.append(seconds)
            elif nbytes >= LARGE and self._round_trips:
                latency = statistics.median(self._round_trips)
                moving = max(seconds - latency, 1e-6)  # never below zero: timer noise
                self._sizes.append(SHARE / (1 - SHARE) * latency * nbytes / moving)

    @property
    def round_trip(self) -> float | None:
        """The median round trip of recent small requests, in seconds (None: none yet)."""
        with self._lock:
            return statistics.median(self._round_trips) if self._round_trips else None

    def efficient_bytes(self) -> int | None:
        """The smallest request that spends `SHARE` of its time moving bytes; None until
        both a small and a large request completed."""
        with self._lock:
            return int(statistics.median(self._sizes)) if self._sizes else None
