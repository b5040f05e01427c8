"""What a Checkpointer does at interpreter exit: say which saves are still persisting,
then let them finish."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from unbroken.job import overlap

log = logging.getLogger("unbroken")


def at_exit(ckpt: Any) -> None:
    """At interpreter exit, say so if a save is still persisting, then let it finish.

    Registered with threading's exit hooks, which run (newest first) on the main thread
    before the interpreter joins worker threads, so the warning comes before the wait."""
    ref = weakref.ref(ckpt)

    def check() -> None:
        live = ref()
        if live is None or live._closed:
            return
        # Training is over: the copies left for the next optimizer step are settled now,
        # or a save waiting for them would keep the interpreter from ever exiting.
        overlap.settle()
        with live._lock:
            pending = [p.step for p in live._pending if not p.done()]
        if pending:
            log.warning(
                "exiting with saves of steps %s still persisting; waiting for them "
                "(call Checkpointer.close() or use `with` to wait explicitly)",
                pending,
            )
        live._worker.shutdown(wait=True)

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        register = atexit.register
    register(check)
