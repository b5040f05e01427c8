"""Silent data corruption: a data-parallel replica that differs between ranks is found at
save time, named (tensor, ranks), recorded as an event and handled as configured."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from ranks import run_ranks
from unbroken.errors import CheckpointError
from unbroken.format.layout import step_dir
from unbroken.format.write_plan import Block
from unbroken.sdc import SUSPECT, Replicated, suspect

pytestmark = pytest.mark.timeout(120)


def _job(rank: int, world: int, path: str, action: str) -> dict:
    from unbroken import Checkpointer, CheckpointError

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    # Legitimately per-rank, under a name not declared replicated: never flagged.
    state = {"model": model, "mine": {"seen": torch.full((3,), float(rank))}}
    ckpt = Checkpointer(path, replicated=Replicated(("model",), action=action))  # type: ignore[arg-type]
    ckpt.save(1, state)  # identical replicas: nothing to say
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1e-3  # one rank's copy silently drifts
    error = None
    try:
        ckpt.save(2, state)
    except CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    marks = {s: suspect(ckpt.storage, step_dir(s)) for s in (1, 2)}
    ckpt.close()
    restored = Checkpointer(path).restore(state) if action == "suspect" else None
    return {"error": error, "marks": marks, "restored": restored}


def _events(folder: str, kind: str = "sdc") -> list[dict]:
    rows = []
    for name in glob.glob(os.path.join(folder, "events-*.jsonl")):
        with open(name) as f:
            rows += [json.loads(line) for line in f]
    return [r for r in rows if r.get("event", r.get("name")) == kind]


@pytest.mark.parametrize("action", ["warn", "refuse", "suspect"])
def test_one_rank_s_corrupted_parameter_is_named_and_handled(tmp_path, monkeypatch, action):
    events = tmp_path / "events"
    monkeypatch.setenv("UNBROKEN_EVENTS_DIR", str(events))
    r0, r1 = run_ranks(_job, str(tmp_path / "ckpt"), action)
    assert r0 == r1 or action == "refuse", (r0, r1)
    [sdc] = _events(str(events))  # one event, from rank 0, for step 2 only
    assert sdc["step"] == 2 and sdc["tensor"] == "model/weight" and sdc["action"] == action
    assert sorted(sdc["values"].values()) == [[0], [1]]
    committed = os.path.exists(tmp_path / "ckpt" / step_dir(2) / "manifest.json")
    if action == "refuse":
        for r in (r0, r1):
            assert r["error"].startswith("SilentCorruptionError"), r
            assert "'model/weight'" in r["error"] and "ranks [0]" in r["error"]
            assert "ranks [1]" in r["error"]
        assert not committed
    else:
        assert r0["error"] is None and committed
    assert r0["marks"][1] is None
    if action == "suspect":
        [row] = r0["marks"][2]
        assert row["tensor"] == "model/weight" and sorted(row["values"].values()) == [[0], [1]]
        show = [sys.executable, "-m", "unbroken", "show", str(tmp_path / "ckpt"), "--step"]
        shown = {n: subprocess.run([*show, str(n)], capture_output=True, text=True, timeout=60)
                 for n in (1, 2)}  # fmt: skip
        assert "SUSPECT" in shown[2].stdout and "model/weight" in shown[2].stdout, shown[2]
        assert shown[1].returncode == 0 and "SUSPECT" not in shown[1].stdout
        # Restoring the suspect step says so, once (rank 0), and still restores it.
        assert r0["restored"] == r1["restored"] == 2
        [told] = _events(str(events), "suspect_restored")
        assert told["step"] == 2 and "model/weight" in told["report"]
    else:
        assert r0["marks"][2] is None


def _block(key: str, xxh3: str, offsets: tuple[int, ...] = (0,)) -> Block:
    return Block(key=key, dtype="float32", shape=(4,), offsets=offsets, local_shape=(2,),
                 nbytes=8, xxh3=xxh3)  # fmt: skip


def test_the_rule_compares_only_declared_state_and_the_same_region():
    rule = Replicated(("model", "optim"))
    by_rank = [
        [_block("model/w", "a"), _block("model/s", "x", (0,)), _block("rng/t", "r0")],
        [_block("model/w", "a"), _block("model/s", "y", (2,)), _block("rng/t", "r1")],
        [_block("model/w", "b"), _block("optim/m", "m"), _block("rng/t", "r2")],
        [_block("model/w", "a"), _block("optim/m", "m")],
    ]
    [d] = rule.divergent(by_rank)  # shards (other offsets) and undeclared names are not
    assert (d.key, d.values) == ("model/w", {"a": [0, 1, 3], "b": [2]})
    with pytest.raises(ValueError, match="'warn', 'refuse' or 'suspect'"):
        Replicated(("model",), action="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top-level state names"):
        Replicated(("model/weight",))  # a tensor's key, not an entry of the state
    assert Replicated(()).divergent(by_rank) == []  # nothing named, no block known: none


class _RefusingMarks:
    """A storage whose server refuses every GET of a suspect mark."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def read(self, path: str) -> bytes:
        if path.endswith(SUSPECT):
            raise CheckpointError(f"GET {path}: 503 SlowDown, retried until the retry timeout")
        return bytes(self.inner.read(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_suspect_mark_that_cannot_be_read_is_said_and_the_restore_stands(tmp_path, caplog):
    """Rank 0 alone reads the mark, beside the restore: a storage error there is a
    warning, never an error, which would fail on one rank a restore the others finished."""
    from unbroken import Checkpointer

    state = {"w": torch.arange(4.0)}
    Checkpointer(str(tmp_path)).save(1, state)
    ckpt = Checkpointer(str(tmp_path))
    ckpt.storage = _RefusingMarks(ckpt.storage)
    back = {"w": torch.zeros(4)}
    with caplog.at_level("WARNING", logger="unbroken"):
        assert ckpt.restore(back) == 1
    assert torch.equal(back["w"], state["w"])
    assert f"{SUSPECT} is unreadable" in caplog.text and "503 SlowDown" in caplog.text


@pytest.mark.parametrize(
    ("replicated", "known", "compares"),
    [
        (Replicated(), [[], []], False),  # FSDP shards: nothing known replicated
        (Replicated(), None, False),
        (Replicated(), [[0], [0]], True),
        (Replicated(auto=False), [[0], [0]], False),
        (Replicated(names=("model",), auto=False), [[], []], True),
    ],
)
def test_the_plan_keeps_every_block_for_the_comparison_only_when_it_compares_some(
    replicated, known, compares
):
    """Rank 0 drops every rank's blocks after the survey unless `compares` says the
    check needs them: where it says no, the check finds nothing even where values differ."""
    blocks = [
        [Block(key="model/w", dtype="F32", shape=(4,), offsets=(0,), local_shape=(4,),
               nbytes=16, xxh3=value)]
        for value in ("aa", "bb")
    ]  # fmt: skip
    assert replicated.compares(known) is compares
    assert bool(replicated.divergent(blocks, known)) is compares
