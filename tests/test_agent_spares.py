"""Warm spares of the node agents of a multi-node ``unbroken run --in-process`` job
(tests/test_multinode.py's `Cluster`): an agent's first ranks come from its spares."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_multinode import Cluster


@pytest.mark.timeout(120)
def test_ranks_from_spares_still_importing_are_no_hang(tmp_path: Path, reference: dict) -> None:
    """Agents without --node-rank start their ranks from their warm spares, which are
    still importing torch when they are given a rank (four at once on these 2 cores: far
    past the 2 s heartbeat timeout). Such a spare is judged hung only once its CPU time
    stands still: it was judged from its assignment, found hung, and the first
    generation aborted (bench/storm.py's (c) start)."""
    c = Cluster(tmp_path, "--heartbeat-timeout=2")  # warm spares: every Cluster's
    try:
        c.agent(None)
        c.agent(None)
        run = c.finish()
    finally:
        c.close()
    assert run["params"] == reference["params"], "not bitwise equal to the uninterrupted run"
    assert {s["seen_generation"] for s in run["starts"]} == {0}, run["starts"]
    assert "made no progress" not in c.text(), c.log()
    assert "from a warm spare" in c.text(), c.log()
