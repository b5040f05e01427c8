"""Save policies, pure: tables of (trigger, step, clock) -> decision, no IO."""

import logging

import pytest

from unbroken.policies import At, Auto, Every, Never, Policy, expected_goodput, young_daly


@pytest.mark.parametrize(
    ("trigger", "step", "now", "last_step", "last_time", "due"),
    [
        (Every(steps=5), 10, 0.0, 5, 0.0, True),
        (Every(steps=5), 11, 0.0, 10, 0.0, False),
        (Every(steps=5), 15, 0.0, None, 0.0, True),  # a resumed job keeps the multiples
        (Every(seconds=60), 7, 100.0, 3, 50.0, False),
        (Every(seconds=60), 8, 110.0, 3, 50.0, True),
        (At([3, 9]), 9, 0.0, None, 0.0, True),
        (At([3, 9]), 4, 0.0, None, 0.0, False),
        (Never(), 100, 1e9, None, 0.0, False),
        (Every(steps=100) | At([7]), 7, 0.0, None, 0.0, True),
        (Every(steps=100) | At([7]), 8, 0.0, None, 0.0, False),
        (Every(steps=100) | Every(seconds=10), 8, 20.0, None, 0.0, True),
    ],
)
def test_triggers(trigger, step, now, last_step, last_time, due):
    assert trigger.due(step, now, last_step, last_time) is due


def test_only_time_triggers_need_the_clock():
    assert not (Every(steps=5) | At([1])).uses_clock
    assert (Every(steps=5) | Every(seconds=1)).uses_clock
    assert not Policy(snapshot=Every(steps=2)).uses_clock
    assert Policy(save=Every(seconds=2)).uses_clock


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one"),
        ({"steps": 2, "seconds": 1.0}, "exactly one"),
        ({"steps": 0}, "at least 1"),
        ({"seconds": 0}, "more than 0"),
    ],
)
def test_bad_triggers_say_why(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Every(**kwargs)


def _run(policy, steps, step_s=1.0, costs=None):
    """Drive ``policy`` as Checkpointer.step does, on a fake clock: the decisions."""
    costs = costs or {}
    now, taken = 0.0, []
    for step in steps:
        action = policy.decide(step, now)
        cost = costs.get(action, 0.0) if action != "none" else 0.0
        now += cost
        policy.done(action, step, now, cost)
        taken.append(action)
        now += step_s
    return taken


@pytest.mark.parametrize(
    ("policy", "steps", "expected"),
    [
        (
            Policy(snapshot=Every(steps=2), save=Every(steps=4)),
            range(1, 9),
            ["none", "snapshot", "none", "save", "none", "snapshot", "none", "save"],
        ),
        (Policy(save=At([2])), [1, 2, 2, 3], ["none", "save", "none", "none"]),
        (
            Policy(save=Every(seconds=2.5)),
            range(1, 8),  # one step a second, from t=0
            ["none", "none", "none", "save", "none", "none", "save"],
        ),
        (Policy(), range(3), ["none"] * 3),
    ],
)
def test_policy_decides_one_action_per_step(policy, steps, expected):
    assert _run(policy, steps) == expected


def test_young_daly_and_goodput():
    assert young_daly(2.0, 3600.0) == pytest.approx(120.0)
    assert expected_goodput(120.0, 2.0, 3600.0) == pytest.approx(1 - 2 / 120 - 120 / 7200)
    with pytest.raises(ValueError, match="mtbf_s > 0"):
        young_daly(1.0, 0.0)


def test_auto_measures_then_chooses_young_daly_intervals_in_steps(caplog):
    auto = Auto(mtbf_s=3600.0, snapshots=True)
    with caplog.at_level(logging.INFO, logger="unbroken"):
        taken = _run(auto, range(1, 200), step_s=1.0, costs={"save": 2.0, "snapshot": 0.02})
    # step 1 measures the step time, 2 and 3 measure a save and a snapshot
    assert taken[:3] == ["none", "save", "snapshot"]
    every = auto.intervals()
    assert every["save"] == round(young_daly(2.0, 3600.0))  # 120 s at 1 s a step
    assert every["snapshot"] == round(young_daly(0.02, 3600.0))  # 12
    snapshots = [s for s, a in zip(range(1, 200), taken, strict=True) if a == "snapshot"]
    assert snapshots[1] - snapshots[0] == every["snapshot"]
    assert "expected goodput" in caplog.text and "save every 120 steps" in caplog.text
    assert 0.9 < auto.goodput() < 1.0


def test_auto_adapts_when_costs_change():
    auto = Auto(mtbf_s=3600.0)
    _run(auto, range(1, 50), step_s=1.0, costs={"save": 2.0})
    before = auto.intervals()["save"]
    for step in range(50, 400):  # saves became 8x dearer
        action = auto.decide(step, float(step * 10))
        auto.done(action, step, float(step * 10), 16.0 if action == "save" else 0.0)
    assert auto.intervals()["save"] < before  # steps of 10 s now: fewer steps apart
    seconds = auto.intervals()["save"] * 10
    assert seconds == pytest.approx(young_daly(16.0, 3600.0), rel=0.25)


def test_auto_refuses_a_bad_mtbf():
    with pytest.raises(ValueError, match="MTBFs must be > 0"):
        Auto(mtbf_s=0)
