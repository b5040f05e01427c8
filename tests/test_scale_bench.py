"""bench/scale.py's smoke size, as CI runs it: every phase at every size, store requests
counted where the phase makes them, and the eager groups' count exactly gloo's mesh."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
PROTOCOL = ("detection", "abort", "generation start")
NO_STORE = ("step agreement", "heal plan", "save plan", "manifest validation")


@pytest.fixture(scope="module")
def result():
    out = subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), "--smoke"],
        cwd=BENCH,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), out.stdout[-2000:]
    return json.loads(last.removeprefix("RESULT "))


def test_every_phase_at_every_size(result):
    assert len(result["runs"]) >= 2
    for n, run in result["runs"].items():
        assert set(run) == set(result["phases"]), n
        for phase, row in run.items():
            assert row["how"] in ("measured", "projected"), (n, phase)
            assert row["s"] is not None and row["s"] >= 0, (n, phase)
    assert set(result["growth"]) == set(result["phases"])


def test_the_largest_smoke_size_runs_in_two_host_processes(result):
    runs = result["runs"]
    largest = max(runs, key=int)
    for phase in (*PROTOCOL, "group creation"):
        assert "host processes: 2" in runs[largest][phase]["note"], runs[largest][phase]
    assert runs[min(runs, key=int)]["detection"]["note"].endswith("host processes: 1")


def test_store_requests_are_counted(result):
    for n, run in result["runs"].items():
        world = int(n)
        for phase in PROTOCOL:
            parties = run[phase]["by_party"]
            assert run[phase]["requests"] == sum(parties.values()) > 0, (n, phase)
            assert not [p for p in parties if p.startswith("?")], (n, phase, parties)
        # the coordinator and the agents both act in every recovery
        assert run["detection"]["by_party"]["coordinator"] > 0
        assert run["abort"]["by_party"]["agents"] >= world // 8 - 1  # every live node settles
        # every healthy rank asks for the generation at least once before it moves on
        assert run["generation start"]["by_party"]["ranks"] >= world - 8
        creation = run["group creation"]
        if creation["how"] == "measured":  # two lazy gloo groups: O(n), not the eager 2n²
            assert creation["requests"] <= 2 * 3 * world, n
        for phase in NO_STORE:  # on the already connected group: transport only
            assert run[phase]["requests"] == 0
            # gathers and tree broadcasts: O(log n) steps, not a ring's n - 1
            per = 3 if phase == "save plan" else 2
            steps = per + 2 * math.ceil(math.log2(world))
            assert run[phase]["steps"] == run[phase]["exchanges"] * steps
        save = run["save plan"]
        assert save["exchanges"] == 3 and save["root_messages"] == 9 * (world - 1)
        assert 0 < save["s"] < save["planner_s"]  # a rank's part, and the whole plan
