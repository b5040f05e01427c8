"""Retention: the rules (pure tables), rank 0's collector (no listing on the save path,
deletion in the background, the newest good step kept), and a property test under
random saves, failed saves, damage, restores and GC."""

import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken import Checkpointer, CheckpointError, CorruptCheckpointError
from unbroken.format.layout import step_dir
from unbroken.retention import (
    Info,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPerWindow,
    doomed,
)

DAY = 86400.0
INFOS = [
    Info(s, created=s * DAY / 4, metric=m)
    for s, m in zip(range(1, 9), [5, 3, 4, 1, 6, 2, 7, 8], strict=True)
]


@pytest.mark.parametrize(
    ("rule", "protected", "deleted"),
    [
        (None, (), []),
        (KeepLast(3), (), [1, 2, 3, 4, 5]),
        (KeepLast(3), (2,), [1, 3, 4, 5]),
        (KeepEvery(4), (), [1, 2, 3, 5, 6, 7]),  # 8 is the newest anyway
        (KeepPerWindow(DAY), (), [1, 2, 4, 5, 6]),  # days: 1-3 | 4-7 | 8
        (KeepBest(2), (), [1, 2, 3, 5, 7]),  # metrics 1 (step 4), 2 (step 6), and 8: newest
        (KeepBest(1, mode="max"), (), [1, 2, 3, 4, 5, 6, 7]),  # step 8 has the max, 8
        (KeepLast(2) | KeepEvery(3), (), [1, 2, 4, 5]),
        (KeepLast(1) | KeepBest(1) | KeepPerWindow(DAY), (), [1, 2, 5, 6]),
    ],
)
def test_rules(rule, protected, deleted):
    assert doomed(rule, INFOS, protected) == deleted


def test_the_newest_step_is_never_doomed():
    assert doomed(KeepBest(1), [Info(1, metric=0.0), Info(2, metric=9.0)]) == []
    assert doomed(KeepEvery(10), [Info(3), Info(7)]) == [3]
    assert doomed(KeepLast(1), []) == []


def test_steps_without_a_metric_are_not_ranked():
    infos = [Info(1, metric=1.0), Info(2), Info(3, metric=0.5), Info(4)]
    assert KeepBest(1).keeps(infos) == {3}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: KeepLast(0), "always kept"),
        (lambda: KeepEvery(0), "at least 1"),
        (lambda: KeepPerWindow(0), "> 0 seconds"),
        (lambda: KeepBest(1, mode="median"), "min or max"),  # type: ignore[arg-type]
    ],
)
def test_bad_rules_say_why(make, match):
    with pytest.raises(ValueError, match=match):
        make()


class _NoListing:
    """A storage that fails any listing: the save path must not need one."""

    def __init__(self, storage):
        self.storage = storage

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def list(self, path):
        raise AssertionError(f"listed {path!r} on the save path")


def test_saves_with_retention_list_nothing_after_the_first(tmp_path):
    state = {"w": torch.zeros(4)}
    Checkpointer(tmp_path).save(1, state)
    ckpt = Checkpointer(tmp_path, keep=KeepLast(2) | KeepEvery(4))
    ckpt.save(2, state)  # the one listing, at the first save
    ckpt.storage = _NoListing(ckpt.storage)
    for step in range(3, 10):
        ckpt.save(step, state, blocking=step % 2 == 0)
    ckpt.wait()
    ckpt.storage = ckpt.storage.storage
    assert ckpt.steps() == [4, 8, 9]


def test_best_metric_is_read_back_when_a_job_reopens(tmp_path):
    state = {"w": torch.zeros(4)}
    ckpt = Checkpointer(tmp_path)
    for step, loss in [(1, 0.9), (2, 0.1), (3, 0.5)]:
        ckpt.save(step, state, metric=loss)
    ckpt.close()
    ckpt = Checkpointer(tmp_path, keep=KeepBest(1))
    ckpt.save(4, state, metric=0.7)
    ckpt.wait()
    assert ckpt.steps() == [2, 4]  # best loss, and the newest


class _FailingWrites:
    def __init__(self, storage):
        self.storage = storage

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def write(self, path, parts):
        if path.endswith(".safetensors"):
            self.storage.write(path, [b"half a file"])
            raise OSError(f"disk full writing {path}")
        self.storage.write(path, parts)


def test_a_failed_save_removes_what_it_wrote(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"w": torch.zeros(4)})
    ckpt.storage = _FailingWrites(ckpt.storage)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(2, {"w": torch.zeros(4)})
    assert sorted(os.listdir(tmp_path)) == ["latest", step_dir(1)]


def _damage(root, step, how):
    folder = os.path.join(root, step_dir(step))
    data = os.path.join(folder, "r00000-000.safetensors")
    if not os.path.exists(data):
        return  # deleted by an earlier damage
    if how == "delete":
        os.remove(data)
    elif how == "truncate":
        os.truncate(data, os.path.getsize(data) - 3)
    else:  # flip a byte of the tensor data: only a checksum finds it
        with open(data, "r+b") as f:
            f.seek(-2, os.SEEK_END)
            byte = f.read(1)
            f.seek(-2, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))


OPS = st.one_of(
    st.tuples(st.just("save")),
    st.tuples(st.just("save_then_damage"), st.sampled_from(["delete", "truncate"])),
    st.tuples(st.just("fail")),
    st.tuples(
        st.just("damage"), st.integers(0, 5), st.sampled_from(["delete", "truncate", "flip"])
    ),
    st.tuples(st.just("restore")),
    st.tuples(st.just("gc")),
)


@settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(keep=st.integers(1, 3), every=st.sampled_from([None, 3]), ops=st.lists(OPS, max_size=12))
def test_retention_never_deletes_the_last_good_checkpoint(keep, every, ops):
    rule = KeepLast(keep) if every is None else KeepLast(keep) | KeepEvery(every)
    with tempfile.TemporaryDirectory() as root:
        ckpt = Checkpointer(root, keep=rule)
        state = {"w": torch.zeros(64)}
        damaged: set[int] = set()
        step, base = 0, None  # the next step saves base + 1 after a restore
        for op in ops:
            before = set(ckpt.steps())
            saves = op[0].startswith("save") or op[0] == "fail"
            rolls_back = base is not None and saves  # retires the steps above base
            if saves:
                step = (base if base is not None else step) + 1
                state["w"].fill_(step)
            if op[0] == "save":
                ckpt.save(step, state)
            elif op[0] == "save_then_damage":  # damage before retention runs
                with ckpt._collector.paused():
                    ckpt.save(step, state)
                    _damage(root, step, op[1])
                    damaged.add(step)
                ckpt._collector.collect()
            elif op[0] == "fail":
                ckpt.storage = _FailingWrites(ckpt.storage)
                with pytest.raises((OSError, CheckpointError)):
                    ckpt.save(step, state)
                ckpt.storage = ckpt.storage.storage
            elif op[0] == "damage" and before:
                victim = sorted(before)[min(op[1], len(before) - 1)]
                _damage(root, victim, op[2])
                damaged.add(victim)
            elif op[0] == "restore":
                try:
                    base = ckpt.restore({"w": torch.zeros(64)})
                except CorruptCheckpointError:
                    base = None  # nothing verifies
            elif op[0] == "gc":
                ckpt._collector.collect()
            if saves:
                base = None
            ckpt.wait()
            after = set(ckpt.steps())
            seen = before | {step} if step in after else before  # and the step just saved
            good = seen - damaged
            if good:
                assert max(good) in after, (op, before, after, damaged)
            if seen and not rolls_back:
                assert max(seen) in after, (op, before, after)
            assert not any(n.startswith("step-") and n not in map(step_dir, after)
                           for n in os.listdir(root)), "a failed save left files"  # fmt: skip
        ckpt.close()


def test_gc_applies_the_same_rules_from_the_command_line(tmp_path, capsys):
    from unbroken.cli.main import main

    ckpt = Checkpointer(tmp_path)
    for step in range(1, 11):
        ckpt.save(step, {"w": torch.zeros(4)}, metric=abs(step - 3))  # best: step 3
    ckpt.close()
    args = ["gc", str(tmp_path), "--keep-last", "2", "--keep-every", "5", "--keep-best", "1"]
    assert main([*args, "--dry-run"]) == 0
    assert "keeping [3, 5, 9, 10]; would delete [1, 2, 4, 6, 7, 8]" in capsys.readouterr().out
    assert Checkpointer(tmp_path).steps() == list(range(1, 11))
    assert main(args) == 0
    assert Checkpointer(tmp_path).steps() == [3, 5, 9, 10]
    assert main(["gc", str(tmp_path), "--keep-per-window", "3650d"]) == 0  # one window
    assert Checkpointer(tmp_path).steps() == [10]
    assert main(["gc", str(tmp_path)]) == 2
    assert "name what to keep" in capsys.readouterr().err
