"""A recovery never waits for a save of the failed generation, and the save it leaves
running cannot damage the step the next generation saves (`unbroken.job.abort.settle`)."""

import json
import subprocess
import sys

import pytest

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
