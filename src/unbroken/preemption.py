"""Saving when the scheduler preempts the job.

Kubernetes eviction and spot reclaims send SIGTERM, then SIGKILL after a grace period;
some schedulers send SIGUSR1 first. A signal handler may run between any two bytecodes of
the training loop, in the middle of a collective, so it only notes the signal. The save
happens at the next step boundary (`Checkpointer.step`), where every rank agrees that a
signal came (any rank's counts) and saves the current state, which is newer than any
snapshot, blocking. The log says what was saved and how long it took against the grace
period; then `Preempted` ends the process.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

log = logging.getLogger("unbroken")


class Preempted(SystemExit):
    """Raised by `Checkpointer.step` once the preemption save is committed: the process
    exits with ``Preemption.exit_code`` unless the loop catches it."""


@dataclass(frozen=True, kw_only=True)
class Preemption:
    """Which signals mean preemption, how long the scheduler waits after one before it
    kills (``grace_s``, for the log and for `Preempted`'s message), and the code the
    process then exits with."""

    signals: tuple[int, ...] = (signal.SIGTERM,)
    grace_s: float = 30.0
    exit_code: int = 0

    def __post_init__(self) -> None:
        if not self.signals:
            raise ValueError("Preemption(signals=()): name at least one signal")
        if self.grace_s <= 0:
            raise ValueError(f"Preemption(grace_s={self.grace_s}): the grace period is > 0")


class Watch:
    """Notes the first preemption signal: its number and when (monotonic clock). The
    handlers are installed in the main thread only (Python delivers signals there);
    `stop` puts the previous ones back."""

    def __init__(self, config: Preemption) -> None:
        self.config = config
        self.signum: int | None = None
        self.at: float | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals are only caught when the Checkpointer is built "
                        "in the main thread; this one will not save on them")  # fmt: skip
            return
        for signum in config.signals:
            self._previous[signum] = signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def report(self, step: int, saved: int | None, took_s: float) -> str:
        """The log line: what was saved, and the time since the signal against the grace."""
        since = 0.0 if self.at is None else time.monotonic() - self.at
        name = signal.Signals(self.signum).name if self.signum is not None else "a peer's signal"
        what = f"saved step {saved} in {took_s:.2f} s" if saved is not None else "nothing new"
        return (
            f"preempted ({name}) at step {step}: {what}, {since:.2f} s after the signal "
            f"of a {self.config.grace_s:.0f} s grace period"
        )

    def stop(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
