"""Every node lost at once: no live replica and no shared memory is left, so the job
restores from storage, and it must still end bitwise equal to an uninterrupted run.

``bench/storm.py --quick`` found this: its two nodes were lost 8 s apart, before the
first loss had healed, and the job came back from the step saved in storage. The DDP
bucket layout (`unbroken.healing.ddp_buckets`) was carried in step records and shared
memory only, both gone; the new wrappers reduced their first step in DDP's initial
layout, which sums the ranks' gradients in another order at 4 ranks, and the run drifted
from there by an ulp. Each saved step now notes the layouts in its info file.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from torch import nn

from test_heal import WORLD, launch
from unbroken.format.directory import Directory
from unbroken.format.layout import INFO, step_dir
from unbroken.healing.stepper import Stepper
from unbroken.job.comm import Comm
from unbroken.storage import open_storage

NODES = ("--in-process", "--simulate-nodes=2", "--nproc-per-node=2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = launch(tmp_path_factory.mktemp("reference"), *NODES)
    assert run["timeline"]["recoveries"] == [] and len(set(run["params"])) == 1
    return run


@pytest.mark.timeout(150)
def test_every_node_lost_restores_from_storage_bitwise(tmp_path, reference):
    """Both simulated nodes die at step 13 (their ranks and their shared memory): every
    rank is replaced, restores step 10 from storage, and ends bitwise equal."""
    fault = "kill-node node=0 step=13;kill-node node=1 step=13"
    run = launch(tmp_path, *NODES, f"--inject-fault={fault}")
    last = {s["rank"]: s for s in sorted(run["starts"], key=lambda s: s["seen_generation"])}
    assert sorted(last) == list(range(WORLD))
    for start in last.values():  # the case at hand: nothing survived but storage
        assert start["restored"] == 10 and start["origins"] == ["storage"] * WORLD, start
    assert run["params"] == reference["params"], "not bitwise after a restore from storage"


@pytest.mark.parametrize(
    "info",
    [b"[", b"[" * 100_000, b'{"ddp_layouts": 5}', b'{"ddp_layouts": {"model": [[0, 0]]}}'],
    ids=["truncated", "deep", "not-layouts", "not-fitting"],
)
def test_malformed_layouts_in_a_saved_steps_info_file_are_ignored_with_a_warning(
    tmp_path, caplog, info
):
    (tmp_path / step_dir(5)).mkdir()
    (tmp_path / step_dir(5) / INFO).write_bytes(info)
    state = {"model": nn.Linear(4, 2), "progress": {"step": 5}}
    stepper = Stepper(Comm(None, timedelta(seconds=5)), f"info-{len(info)}", [], [])
    directory = Directory(open_storage(str(tmp_path)), str(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            stepper.restored(5, state, None, directory)  # the restore goes on: no error
    finally:
        stepper.stop()
    assert "ignoring" in caplog.text and f"{step_dir(5)}/{INFO}" in caplog.text
