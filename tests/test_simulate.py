"""`unbroken simulate`'s discrete-event simulation: event order and arithmetic on failure
schedules worked out by hand, its limits, and the costs read from benchmark output."""

from __future__ import annotations

import json

import pytest

from unbroken.goodput.costs import Cluster, Costs, from_results, strategy_costs
from unbroken.goodput.simulate import simulate
from unbroken.goodput.simulate_cli import main
from unbroken.policies import young_daly


def costs(stall: float = 10.0, since_checkpoint: bool = True) -> Costs:
    return Costs(
        "test",
        detect={"process": 1.0, "node": 2.0, "hang": 30.0},
        restart=3.0,
        init=4.0,
        restore=5.0,
        data=0.5,
        stall=stall,
        lose_since_checkpoint=since_checkpoint,
        step_s=1.0,
    )


def test_a_failure_after_a_checkpoint_loses_the_work_since_and_recovers_in_order():
    out = simulate(costs(), 100.0, 1.0, 400.0, failures=[(150.0, "node")], log=True)
    assert out.log == [
        (100.0, "checkpoint"),
        (110.0, "checkpoint_done"),
        (150.0, "fail:node"),
        (152.0, "detection"),
        (155.0, "restart"),
        (159.0, "init"),
        (164.0, "restore"),
        (164.5, "data"),
        (264.5, "checkpoint"),
        (274.5, "checkpoint_done"),
        (374.5, "checkpoint"),
        (384.5, "checkpoint_done"),
        (400.0, "end"),
    ]
    s = out.seconds
    # Training: 0-100, 110-150 (lost: recomputed), 164.5-264.5, 274.5-374.5, 384.5-400.
    assert s == {
        "productive": 315.5,
        "checkpoint": 30.0,
        "recompute": 40.0,
        "detection": 2.0,
        "restart": 3.0,
        "init": 4.0,
        "restore": 5.0,
        "data": 0.5,
    }
    assert out.recoveries == [14.5] and out.wall_s == 400.0


def test_a_failure_during_a_checkpoint_voids_it():
    out = simulate(costs(), 100.0, 1.0, 200.0, failures=[(105.0, "process")], log=True)
    names = [what for _, what in out.log]
    assert names[:3] == ["checkpoint", "fail:process", "detection"]
    assert "checkpoint_done" not in names[:4]  # interrupted: never committed
    assert out.seconds["checkpoint"] == 5.0  # the void one; the next is past the horizon
    assert out.seconds["recompute"] == 100.0  # everything since the start


def test_a_failure_during_recovery_starts_it_again():
    # The second failure strikes 2 s into the restore (100+1+3+4+2 = 110).
    out = simulate(
        costs(), 1e9, 1.0, 300.0, failures=[(100.0, "process"), (110.0, "hang")], log=True
    )
    names = [what for _, what in out.log]
    assert names[:5] == ["fail:process", "detection", "restart", "init", "fail:hang"]
    assert "restore" not in names[:5]
    # One recovery: from the first fault to training again, 100 -> 110 + 30+3+4+5+0.5.
    assert out.recoveries == [pytest.approx(52.5)]
    assert out.seconds["restore"] == pytest.approx(2.0 + 5.0)
    assert out.seconds["recompute"] == 100.0 and out.failures == 2


def test_live_healing_loses_at_most_half_a_step():
    out = simulate(costs(since_checkpoint=False), 100.0, 1.0, 400.0, failures=[(150.0, "process")])
    assert out.seconds["recompute"] == 0.5


def test_with_no_failures_only_the_checkpoints_cost():
    c = costs(stall=5.0)
    out = simulate(c, 95.0, mtbf_s=1e15, horizon_s=1e6, seed=3)
    assert out.failures == 0
    assert out.goodput == pytest.approx(95.0 / 100.0, abs=1e-4)
    assert set(k for k, v in out.seconds.items() if v) == {"productive", "checkpoint"}


def test_young_daly_picks_near_the_best_interval():
    c = costs(stall=100.0)
    mtbf = 20_000.0
    best = young_daly(c.stall, mtbf)

    def goodput(every: float) -> float:
        return sum(simulate(c, every, mtbf, 200 * 86400.0, seed=s).goodput for s in range(3))

    assert goodput(best) > goodput(best / 4) and goodput(best) > goodput(best * 4)


def test_costs_come_from_recovery_results(tmp_path):
    phases = {
        "detect": 0.1,
        "restart": 2.0,
        "startup": 6.0,
        "pg_init": 0.5,
        "setup": 0.2,
        "restore": 0.7,
        "first_step": 0.1,
    }
    result = {
        "config": {"ranks": 4},
        "scenarios": {"a": {"phases_s": phases, "step_s": 0.09, "state_mib_per_rank": 256.0}},
    }
    f = tmp_path / "out.txt"
    f.write_text("recovery table...\nRESULT " + json.dumps(result) + "\n")
    measured = from_results(f)
    assert set(measured) == {"traditional"}
    m = measured["traditional"]
    assert (m.startup, m.step_s, m.ranks) == (6.0, 0.09, 4)
    c = strategy_costs(
        "traditional", Cluster(gpus=4, startup_s=0.0, job_restart_s=0.0, comm_init_s=0.0), m
    )
    assert c.restart == 2.0 and c.init == pytest.approx(6.7)
    (tmp_path / "none.txt").write_text("RESULT {}\n")
    with pytest.raises(ValueError, match=r"no RESULT line of bench/recovery\.py"):
        from_results(tmp_path / "none.txt")


def test_the_command_compares_both_strategies(capsys):
    assert (
        main(
            [
                "--gpus",
                "2304",
                "--gpu-mtbf-hours",
                "50000",
                "--state-gb-per-gpu",
                "10",
                "--days",
                "10",
                "--seeds",
                "2",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    trad, free = out["strategies"]
    assert (trad["strategy"], free["strategy"]) == ("traditional", "checkpointless")
    assert trad["interval_s"] == trad["young_daly_s"]
    assert 0.5 < trad["goodput"] < free["goodput"] <= 1.0
    assert free["recovery_s"]["node"] < trad["recovery_s"]["node"]
