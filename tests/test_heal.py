"""Healing from live replicas, and DDP staying bitwise at 4 ranks.

A 4-rank DDP job (tests/train_job.py --heal, 2 simulated nodes of 2 ranks) loses a rank
under ``unbroken run --in-process``: the healthy ranks keep their processes and their
live state, the replacement gets the model and optimizer from a healthy replica and its
own per-step record from a peer, no step is rolled back, and the run ends bitwise equal
to an uninterrupted one. At 4 ranks that also needs the DDP bucket layout carried over
(`unbroken.healing.ddp_buckets`); restart-all (plain ``unbroken run``) is held to the same result.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from unbroken.errors import CheckpointError
from unbroken.healing import live, plan, records
from unbroken.healing.records import Record
from unbroken.state import capture

STEPS = 16
SAVE_EVERY = 10
WORLD = 4
TRAIN = Path(__file__).with_name("train_job.py")


def launch(tmp: Path, *options: str, job: tuple[str, ...] = ("--in-process", "--heal")) -> dict:
    """`python -m unbroken.run OPTIONS train_job.py JOB`: final parameters, timeline and
    the start records of every rank and generation. In-process launches take warm spares,
    as the storm's (c) runs: the ranks and their replacements are forked from one process
    that imported torch, not four (about a third of this file's run time here); the cold
    start is tests/test_inprocess.py's."""
    out = tmp / "out"
    out.mkdir(parents=True)
    timeline = tmp / "timeline.json"
    cmd = [
        sys.executable, "-m", "unbroken.run", f"--timeline-json={timeline}", *options,
        *(["--warm-spare"] if "--in-process" in options else []), "--max-restarts=2",
        str(TRAIN), *job, f"--ckpt={tmp / 'ckpt'}", f"--out={out}",
        f"--steps={STEPS}", f"--save-every={SAVE_EVERY}", "--replicas=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_MEMORY_DIR": str(tmp / "shm")}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        "seconds": time.monotonic() - t0,
        "timeline": json.loads(timeline.read_text()),
        "params": [(out / f"final-{r}.bin").read_bytes() for r in range(WORLD)],
        "starts": [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = launch(tmp_path_factory.mktemp("reference"), "--in-process", "--simulate-nodes=2",
                 "--nproc-per-node=2")  # fmt: skip
    assert run["timeline"]["recoveries"] == []
    assert len(set(run["params"])) == 1  # DDP: the ranks agree
    return run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["any step", "a save step"])
def test_killed_rank_heals_from_live_replicas_bitwise(tmp_path, reference, when):
    """A rank killed at a random step, or at a save step: there the snapshot's replication
    can meet the loss first, and the save after it finds the group broken (it once
    escaped as an error of the training code, and every rank restarted)."""
    rng = random.Random()
    victim, step = rng.randrange(WORLD), rng.randint(3, STEPS - 3)
    if when == "a save step":
        victim, step = 1, SAVE_EVERY
    fault = f"kill rank={victim} step={step}"
    run = launch(tmp_path, "--in-process", "--simulate-nodes=2", "--nproc-per-node=2",
                 f"--inject-fault={fault}")  # fmt: skip
    assert run["params"] == reference["params"], fault
    starts = {r: sorted((s for s in run["starts"] if s["rank"] == r),
                        key=lambda s: s["seen_generation"]) for r in range(WORLD)}  # fmt: skip
    recoveries = run["timeline"]["recoveries"]
    for rank, (first, again) in starts.items():
        assert again["seen_generation"] == 1, f"{fault}: rank {rank}; {json.dumps(recoveries)}"
        # The victim was killed as it reached `step`: every rank had finished it.
        assert again["restored"] == step, fault
        assert again["origins"] == ["live"] * WORLD, fault
        kept = first["pid"] == again["pid"]
        assert kept == (rank != victim), f"{fault}: rank {rank} pids {first['pid']}, {again['pid']}"
    [rec] = recoveries
    assert rec["respawned"] == [victim] and rec["steps_redone"] <= 1, rec
    print(f"\n{fault}: {json.dumps(rec)}\nrun {run['seconds']:.1f} s")


@pytest.mark.timeout(120)
def test_a_rank_lost_before_ddp_rebuilt_its_buckets_heals_bitwise(tmp_path, reference):
    """Killed after step 1: DDP reduced that step in its initial bucket layout and
    rebuilds the buckets (from the order the gradients became ready) only as step 2
    starts, so no rebuilt layout exists yet. The new wrappers are given the layout the
    old ones were about to rebuild (`ddp_buckets.Tracker` saw the ready order), and
    step 2 reduces as in the uninterrupted run: bitwise."""
    victim = random.randrange(WORLD)
    fault = f"kill rank={victim} step=1"
    run = launch(tmp_path, "--in-process", "--simulate-nodes=2", "--nproc-per-node=2",
                 f"--inject-fault={fault}")  # fmt: skip
    assert [r["respawned"] for r in run["timeline"]["recoveries"]] == [[victim]]
    assert run["params"] == reference["params"], fault


@pytest.mark.timeout(120)
def test_a_rank_lost_while_healing_another_is_replaced_too_bitwise(tmp_path, reference):
    """A second failure during a recovery: rank 0 dies as it is about to heal rank 3's
    replacement. Generation 1 is aborted while its ranks heal or still join, generation
    2 replaces rank 0 as well, ranks 1 and 2 keep their processes throughout and heal
    both from live replicas (their partners, 3 and 2, hold the lost ranks' records), and
    training ends bitwise equal to an uninterrupted run."""
    fault = "kill rank=3 step=9;crash point=heal rank=0 hit=1"
    run = launch(tmp_path, "--in-process", "--simulate-nodes=2", "--nproc-per-node=2",
                 f"--inject-fault={fault}")  # fmt: skip
    assert run["params"] == reference["params"]
    assert [r["respawned"] for r in run["timeline"]["recoveries"]] == [[3], [0]]
    for rank in range(WORLD):
        mine = sorted((s for s in run["starts"] if s["rank"] == rank),
                      key=lambda s: s["seen_generation"])  # fmt: skip
        assert mine[-1]["seen_generation"] == 2 and mine[-1]["restored"] == 9, mine
        assert mine[-1]["origins"] == ["live"] * WORLD, mine
        kept = mine[0]["pid"] == mine[-1]["pid"]
        assert kept == (rank in (1, 2)), mine
    print(f"\n{fault}: {json.dumps(run['timeline']['recoveries'])}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("point", "hit", "restored"),
    [("step-gradients", 8, 8), ("step-prepared", 8, 9), ("step-applied", 9, 9)],
)
def test_a_rank_lost_at_any_moment_of_a_step_costs_no_step(
    tmp_path, reference, point, hit, restored
):
    """Rank 3 dies inside step 9 (`unbroken.healing.inflight`): after the gradient
    exchange, before the step is prepared (every survivor stops before applying it: all
    heal at step 8, and step 9, in flight, runs again); once prepared, before the
    optimizer applies it; or applied, before its record is sent (the survivors applied
    it: rank 3's record of step 9 is rebuilt from the prepared one). Each heals live,
    no survivor loses its process or a step it applied, bitwise."""
    fault = f"crash point={point} rank=3 hit={hit}"
    run = launch(tmp_path, "--in-process", "--simulate-nodes=2", "--nproc-per-node=2",
                 f"--inject-fault={fault}")  # fmt: skip
    assert run["params"] == reference["params"], fault
    for rank in range(WORLD):
        mine = sorted((s for s in run["starts"] if s["rank"] == rank),
                      key=lambda s: s["seen_generation"])  # fmt: skip
        assert mine[-1]["restored"] == restored, (fault, mine)
        assert mine[-1]["origins"] == ["live"] * WORLD, (fault, mine)
        assert (mine[0]["pid"] == mine[-1]["pid"]) == (rank != 3), (fault, mine)
    [rec] = run["timeline"]["recoveries"]
    assert rec["steps_redone"] == 0, rec


@pytest.mark.timeout(120)
def test_survivors_split_by_a_peer_lost_in_the_barrier_are_rolled_forward(tmp_path, reference):
    """Rank 3 dies in step 9's barrier, which completes on ranks 0 and 2 and fails on
    rank 1 (gloo's barrier can; `train_job.py --split-barrier` makes rank 1 the one it
    fails on, and the fault kills rank 3 just past it). Ranks 0 and 2 apply step 9, rank
    1 does not. The heal brings rank 1 forward to step 9 (and rank 3's replacement, from
    the prepared record only rank 1 may hold), never the others back: every rank
    restores step 9 live, no step is redone, bitwise."""
    nodes = ("--in-process", "--simulate-nodes=2", "--nproc-per-node=2")
    fault = "--inject-fault=crash point=step-prepared rank=3 hit=8"
    job = ("--in-process", "--heal", "--split-barrier=9")
    run = launch(tmp_path, *nodes, fault, job=job)
    assert run["params"] == reference["params"]
    for rank in range(WORLD):
        mine = sorted((s for s in run["starts"] if s["rank"] == rank),
                      key=lambda s: s["seen_generation"])  # fmt: skip
        assert mine[-1]["restored"] == 9 and mine[-1]["origins"] == ["live"] * WORLD, mine
        assert (mine[0]["pid"] == mine[-1]["pid"]) == (rank != 3), mine
    [rec] = run["timeline"]["recoveries"]
    assert rec["steps_redone"] == 0 and rec["respawned"] == [3], rec


@pytest.mark.timeout(240)
def test_a_model_wrapped_part_by_part_heals_bitwise(tmp_path):
    """Each layer its own DDP wrapper (the state holds the whole model): every part's
    bucket layout is kept by its path in the model (``model:0``, ``model:2``), so the
    replacement's new wrappers reduce as before and the run stays bitwise."""
    job = ("--in-process", "--heal", "--parts")
    nodes = ("--in-process", "--simulate-nodes=2", "--nproc-per-node=2")
    alone = launch(tmp_path / "reference", *nodes, job=job)
    run = launch(tmp_path / "healed", *nodes, "--inject-fault=kill rank=3 step=9", job=job)
    assert [r["respawned"] for r in run["timeline"]["recoveries"]] == [[3]]
    assert len(set(alone["params"])) == 1
    assert run["params"] == alone["params"]


@pytest.mark.timeout(150)
def test_restart_all_at_4_ranks_is_bitwise(tmp_path, reference):
    """Plain `unbroken run`: every worker restarts and builds a new DDP wrapper, which
    gets the rebuilt bucket layout noted in shared memory before its first iteration."""
    fault = f"kill rank={random.randrange(WORLD)} step={random.randint(3, STEPS - 3)}"
    run = launch(tmp_path, "--nproc-per-node=4", "--monitor-interval=0.1",
                 f"--inject-fault={fault}", job=())  # fmt: skip
    assert run["params"] == reference["params"], fault
    restarted = [s for s in run["starts"] if s["attempt"] == 1]
    assert len(restarted) == WORLD and {s["origins"][0] for s in restarted} == {"memory"}


# -- the parts, without processes ------------------------------------------------------


def table(*rows: tuple[int | None, dict[int, list[int]]]) -> list[dict]:
    return [{"live": live, "held": {str(k): v for k, v in held.items()}} for live, held in rows]


def test_plan_heals_only_where_every_lost_record_is_held_at_the_live_step():
    ok = plan.plan(table((7, {}), (None, {}), (7, {1: [6, 7]}), (7, {3: [7]})))
    assert ok == plan.Plan(step=7, source={1: 0}, holder={1: 2})
    two = plan.plan(table((5, {2: [5]}), (5, {3: [5]}), (None, {}), (None, {})))
    assert two is not None and two.source == {2: 0, 3: 1}  # spread over the live ranks
    # A rank one step ahead, and no prepared record of its step anywhere: no exact heal.
    assert plan.plan(table((7, {1: [7]}), (None, {}), (8, {}), (7, {}))) is None
    # The lost rank's record of the live step is held nowhere.
    assert plan.plan(table((7, {1: [6]}), (None, {}), (7, {}), (7, {}))) is None
    assert plan.plan(table((None, {}), (None, {}))) is None  # nothing live: restart-all
    assert plan.plan(table((4, {}), (4, {}))) == plan.Plan(4, {}, {})


def _flight(after: int, post: dict, pre: dict, **following: dict | None) -> dict:
    return {"after": after, "post": post, "pre": pre, "held": {},
            "next": {"own": following.get("own"), "held": following.get("held") or {}}}  # fmt: skip


def test_plan_rolls_a_rank_stopped_in_the_barrier_forward_never_the_others_back():
    """Node 1 dies in step 9's barrier: ranks 0 and 2 got past it and applied step 9,
    rank 1 did not (gloo's barrier fails on some survivors and not others). Rank 1 is
    healed forward to 9 like a lost rank, its record rebuilt from its own prepared one;
    so is rank 3, whose prepared record only rank 1 holds. The entry every rank changes
    alike after the step (``progress``) comes from the source's record; the per-rank one
    the update leaves alone (``rng``) from the prepared record."""
    ahead = [_flight(8, {"progress": "p9", "rng": f"r{r}"}, {"progress": "p8", "rng": f"r{r}"})
             for r in (0, 2)]  # fmt: skip
    mine = {"progress": "p8", "rng": "r1"}
    behind = _flight(7, {"progress": "p8", "rng": "r1"}, {"progress": "p7", "rng": "r1"},
                     own=mine, held={"3": {"progress": "p8", "rng": "r3"}})  # fmt: skip
    rows = table((9, {}), (8, {}), (9, {}), (None, {}))
    for r, flight in ((0, ahead[0]), (1, behind), (2, ahead[1])):
        rows[r]["flight"] = flight
    chosen = plan.plan(rows)
    assert chosen == plan.Plan(
        step=9, source={1: 0, 3: 2}, holder={1: 1, 3: 1}, rebuilt={1: ["progress"], 3: ["progress"]}
    )
    # Rank 1 never prepared step 9: it cannot be brought forward, nor the others back.
    rows[1]["flight"] = {**behind, "next": {"own": None, "held": behind["next"]["held"]}}
    assert plan.plan(rows) is None
    # An entry the update changes, and per rank: it cannot be rebuilt.
    rows[1]["flight"] = behind
    rows[2]["flight"] = _flight(8, {"progress": "p9", "rng": "x"}, {"progress": "p8", "rng": "r2"})
    assert plan.plan(rows) is None
    # Two steps apart: no heal.
    assert plan.plan(table((9, {}), (7, {}), (9, {}), (9, {}))) is None


def test_record_keeps_only_what_replicas_do_not_share_and_checks_what_it_reads():
    model = nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    extra = torch.arange(4.0)
    state = {"model": model, "optim": optim, "progress": {"step": 3}, "extra": extra}
    record = Record.make(3, 1, state, layouts={})
    assert set(record.header["tree"]) == {"progress", "extra"}
    again = Record.decode(record.data, "test")
    assert again.header == record.header and torch.equal(again.tensors()["extra"], extra)
    damaged = bytearray(record.data)
    damaged[-1] ^= 1
    with pytest.raises(CheckpointError, match="checksum"):
        Record.decode(bytes(damaged), "rank 3")
    with pytest.raises(CheckpointError, match="not readable"):
        Record.decode(b"\x05\x00", "rank 3")
    # An optimizer step moves the state past the record: the fingerprint says so.
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    assert records.fingerprint(state) != record.header["fingerprint"]


def test_registry_keeps_the_two_newest_records_per_rank():
    job = f"test-{os.getpid()}-{random.random()}"
    for step in range(5):
        records.keep_own(job, Record.make(step, 2, {"p": {"s": step}}))
        records.keep_held(job, 0, step, b"x")
    own = records.own(job, 2)
    assert own is not None and own.step == 4
    assert records.own(job, 1) is None  # under another rank number: not this rank's
    assert sorted(records.held(job)[0]) == [3, 4]
    records.forget(job)
    assert records.own(job, 2) is None and records.held(job) == {}


def _exchange_job(rank: int, world: int) -> list[int]:
    from datetime import timedelta

    from unbroken.job.comm import Comm

    comm = Comm(None, timedelta(seconds=30))
    peer = 1 - rank
    sizes = [0, 10, records.FIRST - 8, records.FIRST - 7, 300_000]
    got = []
    for n in sizes:
        data = bytes((rank + i) % 251 for i in range(n))
        back = records.exchange(comm, {peer: data}, [peer])[peer]
        assert back == bytes((peer + i) % 251 for i in range(n)), n
        got.append(len(back))
    return got


@pytest.mark.timeout(60)
def test_records_travel_whole_whatever_their_size():
    from ranks import run_ranks

    assert run_ranks(_exchange_job, timeout=50) == [[0, 10, 65528, 65529, 300000]] * 2


@pytest.mark.timeout(90)
def test_a_rank_past_its_record_is_healed_back_to_the_live_step_never_mixed():
    """The optimizer-step window: a fault after a rank's ``optimizer.step`` but before its
    next record leaves it one step ahead of what it recorded. Its fingerprint tells, so
    it is healed like a lost rank (the record's step, from a live replica); when every
    rank is past its record, healing refuses and changes nothing (snapshot path)."""
    from ranks import run_ranks

    job = f"window-{os.getpid()}-{random.random()}"
    # (healed step, state == what was recorded, state == what it was before healing)
    assert run_ranks(_window_job, job, timeout=80) == [
        [(2, True, True), (None, False, True)],  # rank 0: live in case 0, untouched
        [(2, True, False), (None, False, True)],  # rank 1: brought back to step 2
    ]


def _window_job(rank: int, world: int, job: str) -> list[tuple[int | None, bool, bool]]:
    from datetime import timedelta

    from unbroken.job.comm import Comm

    comm = Comm(None, timedelta(seconds=30))
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    state: dict = {"model": model, "optim": optim, "progress": {"step": 0}}

    def train_step(step: int) -> None:
        optim.zero_grad()
        model(torch.ones(2, 8)).pow(2).sum().backward()
        optim.step()
        state["progress"] = {"step": step}

    def snapshot() -> list[torch.Tensor]:
        optim_state = [t for s in optim.state.values() for t in s.values()]
        return [t.clone() for t in [*model.state_dict().values(), *optim_state]]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    results: list[tuple[int | None, bool, bool]] = []
    for case, stepped in enumerate([{1}, {0, 1}]):
        for step in (1, 2):
            train_step(step)
            record = Record.make(step, rank, state, layouts={}, data_parallel=True)
            records.keep_own(f"{job}-{case}", record)
            got = records.exchange(comm, {1 - rank: record.data}, [1 - rank])
            records.keep_held(f"{job}-{case}", 1 - rank, step, got[1 - rank])
        recorded = snapshot()
        if rank in stepped:
            train_step(3)  # the fault comes after this step, before its record
        before = snapshot()
        healed = live.heal(comm, f"{job}-{case}", state, capture(state))
        at = None if healed is None else healed[0].step
        results.append((at, same(snapshot(), recorded), same(snapshot(), before)))
        if healed is None:
            assert state["progress"] == {"step": 3}
        else:
            assert state["progress"] == {"step": 2}  # the record's per-rank state, too
    return results
