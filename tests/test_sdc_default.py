"""Silent data corruption found by default: state unbroken knows to be replicated (DDP
parameters and their optimizer state, DTensor replicas) is compared at every save with
nothing declared; BatchNorm statistics and other per-rank state never alarm; the check
can be turned off; a restore of a step marked suspect warns; and a live heal ends with a
checksum vote that refuses a replacement that differs from its source."""

from __future__ import annotations

import glob
import json
import logging
import os
import random
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from ranks import run_ranks
from unbroken.format.layout import step_dir
from unbroken.sdc import Replicated, suspect

pytestmark = pytest.mark.timeout(150)

WEIGHT = {"wrapper": "model/module.0.weight", "inner": "model/0.weight"}
EXP_AVG = "optim/state/0/exp_avg"  # the first parameter's: the first Linear's weight


class _Lines(logging.Handler):
    """The ``unbroken`` log's warnings of one rank, kept to return from it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _ddp_job(rank: int, world: int, path: str, entry: str, off: bool) -> dict[str, Any]:
    """A DDP model with BatchNorm trained one step per save on each rank's own batch
    (so the running statistics differ between ranks after the forward); before the
    second save rank 1's copy of one weight and of its Adam moment silently drift."""
    from torch.nn.parallel import DistributedDataParallel

    from unbroken import Checkpointer

    lines = _Lines()
    logging.getLogger("unbroken").addHandler(lines)
    torch.manual_seed(0)
    first, norm = nn.Linear(4, 4), nn.BatchNorm1d(4)
    net = nn.Sequential(first, norm, nn.Linear(4, 2))
    policy = Replicated(auto=False) if off else None
    ckpt = Checkpointer(path, replicated=policy)  # before the wrapper's first forward
    ddp = DistributedDataParallel(net)  # broadcast_buffers=True: BatchNorm re-synced
    optim = torch.optim.Adam(ddp.parameters(), lr=0.1)
    state = {
        "model": ddp if entry == "wrapper" else net,
        "optim": optim,
        "mine": {"seen": torch.full((3,), float(rank))},  # per-rank, and never flagged
    }
    batches = torch.Generator().manual_seed(rank)

    def train() -> None:
        optim.zero_grad()
        ddp(torch.randn(8, 4, generator=batches)).pow(2).sum().backward()
        optim.step()

    train()
    mean = norm.running_mean
    assert mean is not None
    stats = [mean.clone() for _ in range(world)]
    torch.distributed.all_gather(stats, mean)
    ckpt.save(1, state)
    with torch.no_grad():
        if rank == 1:  # one rank's copies silently drift
            first.weight[0, 0] += 1e-3
            optim.state[first.weight]["exp_avg"][0, 0] += 1.0
    ckpt.save(2, state)
    marks = {s: suspect(ckpt.storage, step_dir(s)) for s in (1, 2)}
    ckpt.close()
    at_save = list(lines.lines)
    lines.lines.clear()
    again = Checkpointer(path, replicated=policy)
    restored = again.restore(state, step=2)
    again.close()
    stats_differ = not torch.equal(stats[0], stats[1])
    return {"marks": marks, "saved": at_save, "restored": restored, "said": lines.lines,
            "stats_differ": stats_differ}  # fmt: skip


def _events(folder: str, kind: str) -> list[dict[str, Any]]:
    rows = []
    for name in glob.glob(os.path.join(folder, "events-*.jsonl")):
        with open(name) as f:
            rows += [json.loads(line) for line in f]
    return [r for r in rows if r.get("event") == kind]


@pytest.mark.parametrize("entry", ["wrapper", "inner"])
def test_a_ddp_replica_that_drifts_is_named_by_default_and_batchnorm_never_alarms(
    tmp_path, monkeypatch, entry
):
    """No `Replicated` given. The state holds the DDP wrapper, or the module it wraps
    (the wrapper seen at its forward). BatchNorm's running statistics differ between the
    ranks at both saves, the per-rank entry always: step 1 is clean. At step 2 exactly
    the drifted weight and Adam moment are named, with the ranks holding each value; the
    step is committed and marked suspect (the default), and restoring it warns."""
    events = tmp_path / "events"
    monkeypatch.setenv("UNBROKEN_EVENTS_DIR", str(events))
    r0, r1 = run_ranks(_ddp_job, str(tmp_path / "ckpt"), entry, False, timeout=140)
    assert r0["stats_differ"] and r1["stats_differ"]  # the premise: buffers differ
    found = _events(str(events), "sdc")
    assert {e["step"] for e in found} == {2}, found  # nothing at step 1: buffers are not compared
    assert sorted(e["tensor"] for e in found) == sorted([WEIGHT[entry], EXP_AVG])
    for e in found:
        assert sorted(e["values"].values()) == [[0], [1]] and e["action"] == "suspect"
    [warned] = [line for line in r0["saved"] if "replicas differ" in line]
    assert "step 2" in warned and repr(WEIGHT[entry]) in warned and "ranks [1]" in warned
    assert "marked suspect" in warned and "Replicated(" in warned
    assert not [line for line in r1["saved"] if "replicas differ" in line]  # rank 0 says it
    assert r0["marks"][1] is None
    assert sorted(row["tensor"] for row in r0["marks"][2]) == sorted([WEIGHT[entry], EXP_AVG])
    # Restoring the suspect step warns, naming the step and what diverged; it restores.
    assert r0["restored"] == r1["restored"] == 2
    [said] = [line for line in r0["said"] if "differed when saved" in line]
    assert "step 2" in said and WEIGHT[entry] in said and "restore an earlier step" in said


def test_the_automatic_check_is_turned_off_by_one_switch(tmp_path, monkeypatch):
    """``Replicated(auto=False)``: the same drift is saved without a word or a mark."""
    events = tmp_path / "events"
    monkeypatch.setenv("UNBROKEN_EVENTS_DIR", str(events))
    r0, r1 = run_ranks(_ddp_job, str(tmp_path / "ckpt"), "wrapper", True, timeout=140)
    assert _events(str(events), "sdc") == []
    assert r0["marks"] == {1: None, 2: None}
    assert r0["restored"] == r1["restored"] == 2
    assert not [x for r in (r0, r1) for x in r["saved"] + r["said"] if "replica" in x]


def _dtensor_job(rank: int, world: int, path: str) -> list[Any] | None:
    """HSDP's layout on 2 ranks: a (replicate=2, shard=1) mesh, so both ranks hold the
    same region of ``hsdp``; ``fsdp`` is sharded over both (different regions)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from unbroken import Checkpointer

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (2,))
    hsdp = distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Replicate(), Shard(0)])
    fsdp = distribute_tensor(torch.arange(8.0), flat, [Shard(0)])
    state = {"w": {"hsdp": hsdp, "fsdp": fsdp}}
    ckpt = Checkpointer(path)
    ckpt.save(1, state)
    if rank == 1:
        hsdp.to_local()[1, 2] += 1.0  # a replica group's copy drifts
    ckpt.save(2, state)
    marks = suspect(ckpt.storage, step_dir(2))
    ckpt.close()
    return marks


def test_the_replica_dimension_of_a_dtensor_is_compared_by_default(tmp_path):
    marks, _ = run_ranks(_dtensor_job, str(tmp_path), timeout=140)
    assert marks is not None, "the drifted replica was saved without a mark"
    [row] = marks  # the shards of "fsdp" hold different regions: never compared
    assert row["tensor"] == "w/hsdp" and sorted(row["values"].values()) == [[0], [1]]


def _known_job(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from unbroken.sdc import known

    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    other, extra = nn.Linear(2, 2), torch.zeros(2, requires_grad=True)
    optim = torch.optim.Adam([*other.parameters(), *net.parameters(), extra])
    state = {"model": net, "other": other, "optim": optim}
    before = known(state, {})
    # DDP leaves "1.bias" alone (not synced): so does the check
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["1.bias"])
    ddp = DistributedDataParallel(net)
    found = known(state, {"model": ddp})
    holds = {
        key: found.holds(key, torch.zeros(1))
        for key in ("optim/state/2/exp_avg", "model/1.running_mean", "optim/state/0/exp_avg",
                    "optim/state/6/exp_avg", "model/1.bias")
    }  # fmt: skip
    return {"before": before, "found": found, "holds": holds,
            "off": Replicated(auto=False).known(state, {"model": ddp})}  # fmt: skip


def test_what_is_known_replicated_is_ddp_parameters_and_their_optimizer_state():
    """A DDP wrapper around ``net`` (as the tracker gives it) makes its parameters and
    their optimizer state known, not its buffers nor what DDP ignores; a module outside
    DDP and a plain parameter of the same optimizer are not."""
    from unbroken.sdc import Known

    [got] = run_ranks(_known_job, world=1, timeout=100)
    assert got["before"] == Known()  # no DDP anywhere: nothing known
    assert got["found"].keys == {"model/0.weight", "model/0.bias", "model/1.weight"}
    assert got["found"].optimizer_state == {"optim/state/2", "optim/state/3", "optim/state/4"}
    assert got["holds"] == {
        "optim/state/2/exp_avg": True,  # net's first weight
        "model/1.running_mean": False,  # a buffer
        "optim/state/0/exp_avg": False,  # other's weight
        "optim/state/6/exp_avg": False,  # extra
        "model/1.bias": False,  # ignored by DDP
    }
    assert got["off"] is None


def test_the_policy_s_defaults_and_switches():
    assert Replicated() == Replicated(names=(), action="suspect", auto=True)
    with pytest.raises(ValueError, match="tuple of top-level state names"):
        Replicated("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="True or False"):
        Replicated(auto="no")  # type: ignore[arg-type]


# -- the heal's vote ------------------------------------------------------------------


def _heal_job(rank: int, world: int, job: str) -> list[str | None]:
    """Rank 0 is live at step 1; rank 1, a replacement, heals from it twice: first built
    like its source (the vote passes), then built in float64, so that ``load_state_dict``
    casts what arrived: the bytes it received verified, yet what it holds is not its
    source's. Returns each heal's error (None: healed)."""
    from unbroken.errors import CheckpointError
    from unbroken.healing import live, records
    from unbroken.healing.records import Record
    from unbroken.job.comm import Comm
    from unbroken.state import capture

    comm = Comm(None, timedelta(seconds=30))
    outcomes: list[str | None] = []
    for case, dtype in enumerate([torch.float32, torch.float64]):
        torch.manual_seed(0)
        model = nn.Linear(8, 4).to(torch.float32 if rank == 0 else dtype)
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        state: dict[str, Any] = {"model": model, "optim": optim, "progress": {"step": 0}}
        if rank == 0:  # trained one step: the replacement has all of it to receive
            model(torch.ones(2, 8)).sum().backward()
            optim.step()
            state["progress"] = {"step": 1}
            records.keep_own(f"{job}-{case}", Record.make(1, 0, state, layouts={},
                             data_parallel=True))  # fmt: skip
            records.keep_held(f"{job}-{case}", 1, 1, Record.make(1, 1, state).data)
        try:
            healed = live.heal(comm, f"{job}-{case}", state, capture(state))
            outcomes.append(None if healed is not None else "not healed")
        except CheckpointError as e:
            outcomes.append(str(e))
    return outcomes


def test_a_replacement_that_does_not_hold_its_source_s_state_fails_the_vote_on_every_rank():
    job = f"vote-{os.getpid()}-{random.random()}"
    source, replacement = run_ranks(_heal_job, job, timeout=140)
    assert source[0] is None and replacement[0] is None  # built alike: healed, vote passed
    for message in (source[1], replacement[1]):
        assert message is not None, "the float64 replacement was healed without a word"
        assert "rank 1, healed at step 1" in message and "rank 0" in message, message
        assert "'model/weight'" in message and "torch.float64" in message, message
    assert "failed on another rank" in source[1]  # told by the vote, not by its own check
