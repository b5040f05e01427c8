"""A recovery never waits for a save of the failed generation, and the save it leaves
running cannot damage the step the next generation saves (`unbroken.job.abort.settle`)."""

import json
import subprocess
import sys
import threading
import time

import pytest

from unbroken.errors import PeerLostError
from unbroken.job import abort

# One process, as a surviving rank under `unbroken run --in-process`: generation 1's
# background save of step 5 is stuck writing (storage gated); the recovery abandons it;
# generation 2 saves step 5 again while the old save is still running, then the old one
# fails as an aborted group's save does.
_SCRIPT = """
import json, sys, threading, time
import torch
sys.path.insert(0, sys.argv[2])
from test_async import GatedStorage
from unbroken import Checkpointer
from unbroken.job import abort

path = sys.argv[1]
old = Checkpointer(path)
old.storage = gated = GatedStorage(old.storage, fail=True)
old.save(5, {"w": torch.zeros(1000)}, blocking=False)
assert gated.entered.wait(30), "the old save never started writing"
started = time.monotonic()
busy = abort.abandon_all()
abandon_s = time.monotonic() - started

new = Checkpointer(path)
handle = new.save(5, {"w": torch.full((1000,), 7.0)}, blocking=False)
time.sleep(0.5)
waited = not handle.done()  # the new save waits for the old one to end
gated.gate.set()  # the old save fails now, as its aborted group would make it
committed = handle.wait()
got = {"w": torch.zeros(1000)}
Checkpointer(path).restore(got)
print(json.dumps({"abandon_s": abandon_s, "busy": busy, "waited": waited,
                  "committed": committed, "steps": Checkpointer(path).steps(),
                  "value": float(got["w"].sum())}))
"""


@pytest.mark.timeout(60)
def test_a_recovery_abandons_a_running_save_at_once_and_the_next_save_is_whole(tmp_path):
    tests = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "ck"), tests],
        capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["abandon_s"] < 0.5, found  # was the 2 s wait of `abandon_slow`
    assert len(found["busy"]) == 1 and "Checkpointer(" in found["busy"][0], found
    assert found["waited"], found
    assert found["committed"] is True and found["steps"] == [5], found
    assert found["value"] == 7000.0, found


class _Abandoned:
    """A Checkpointer as `abort.abandon_all` sees it: its save thread's work."""

    def __init__(self, work: list) -> None:
        self.work = work

    def _abandon(self) -> list:
        return [f for f in self.work if not f.done()]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("starts", ["aborted", "next generation"])
def test_a_save_queued_behind_a_stuck_one_fails_at_once_and_the_next_generation_saves(starts):
    """bench/storm.py, a hung rank: a survivor's background save was queued on its save
    thread behind a transfer stuck on the hung peer; the abort freed the transfer, the
    recovery abandoned both, and the save then started and waited for the abandoned
    work, itself among it, for 60 s (`abort.SETTLE_S`), while the next generation's saves
    waited behind it, and every peer with them: a 10 s stall, until the watchdog aborted
    again. Now abandoned work raises, whether it starts while its generation is aborted
    or once the next one has begun (which clears the abort), and the next save goes on."""
    from unbroken.job.background import SaveThread

    abort.begin(1)
    try:
        stuck, thread = threading.Event(), SaveThread()
        transfer = thread.submit(stuck.wait)  # on the hung peer, until the abort
        queued = thread.submit(abort.settle, "saving step 660")
        abort.register(kept := _Abandoned([transfer, queued]))
        abort.shutdown()  # generation 1 aborted
        assert len(abort.abandon_all()) == 1
        if starts == "next generation":
            abort.begin(2)
        started = time.monotonic()
        stuck.set()  # freed: the queued save starts now
        with pytest.raises(PeerLostError, match="saving step 660: stopped"):
            queued.result(timeout=10)
        assert time.monotonic() - started < 2
        abort.begin(2)
        started = time.monotonic()
        next_save = SaveThread().submit(abort.settle, "saving step 670")
        assert next_save.result(timeout=10) is None
        assert time.monotonic() - started < 2
        del kept
    finally:
        abort.begin()
        abort._enabled = False  # this process is not under in-process recovery
