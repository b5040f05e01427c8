"""bench/sdc_cost.py's smoke size, as CI runs it: a 2-rank DDP job saved with the default
replica check on and off, every method timed, and a healthy job's step never suspect."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
METHODS = {"async_on", "async_off", "blocking_on", "blocking_off"}


def test_the_smoke_run_times_every_method_and_compares_real_ddp_state():
    out = subprocess.run(
        [sys.executable, str(BENCH / "sdc_cost.py"), "--smoke"],
        cwd=BENCH,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), out.stdout[-2000:]
    result = json.loads(last.removeprefix("RESULT "))
    assert set(result["blocking_ms"]) == set(result["durable_ms"]) == METHODS
    assert set(result["on_minus_off"]) == {
        "block.async", "durable.async", "block.blocking", "durable.blocking",
    }  # fmt: skip
    # parameters, Adam's two moments and its step counters: all compared by default
    assert result["replicated"]["tensors"] == 16 and result["replicated"]["mib"] > 20
    assert result["suspect"] is False
    walk, compare = result["check_ms"]["walk"], result["check_ms"]["compare"]
    assert 0 < walk["best"] + compare["best"] < result["limit_ms"]["best"]
