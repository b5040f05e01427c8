"""Hostile input a live heal meets: what a peer sends (the plan's rows, the live
replica's description of its state, a step record) and the DDP layouts a restore finds
in shared memory or in a peer's record. Each is checked whole before anything it names
is used or allocated; anything malformed is a `CheckpointError` naming the peer on every
rank, with the state untouched, or (layouts) ignored with a warning."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import xxhash
from torch import nn

from ranks import run_ranks
from unbroken.errors import CheckpointError
from unbroken.healing import live, plan, records
from unbroken.healing.peers import replicated_entries
from unbroken.healing.records import Record
from unbroken.state import capture

Change = Callable[[dict[str, Any]], bytes]


def _digest(table: Any) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(table).encode())


def _sent(change: Callable[[dict[str, Any]], None]) -> Change:
    """A description changed by ``change``, its digest made to match its new table (a
    liar that is consistent gets past the digest, to the checks behind it)."""

    def send(meta: dict[str, Any]) -> bytes:
        change(meta)
        meta["digest"] = _digest(meta.get("tensors"))
        return json.dumps(meta).encode()

    return send


def _deep(meta: dict[str, Any]) -> bytes:
    meta["tree"]["model"] = "DEEP"
    return json.dumps(meta).encode().replace(b'"DEEP"', b"[" * 5000 + b"]" * 5000)


def _lacked(key: str, shape: list[int]) -> Change:
    """A tensor the live state lacks, listed and placed in the tree: 4 GiB here."""

    def change(meta: dict[str, Any]) -> None:
        meta["tensors"].append([key, "F32", shape, "0" * 16])
        name, rest = key.split("/", 1)
        if name == "model":
            meta["tree"]["model"][rest] = {"__tensor__": key}
        else:  # optimizer state of parameter 0: {"state": {"__items__": [[0, {...}]]}}
            meta["tree"][name]["state"]["__items__"][0][1]["huge"] = {"__tensor__": key}

    return _sent(change)


def _set(path: list[Any], value: Any) -> Change:
    def change(meta: dict[str, Any]) -> None:
        target = meta
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return _sent(change)


HOSTILE: dict[str, Change] = {
    "deep nesting": _deep,
    "missing tensor table": _sent(lambda m: m.pop("tensors")),
    "tree not an object": _set(["tree"], [1, 2]),
    "shape of a wrong type": _set(["tensors", 0, 2], "8"),
    "negative size": _set(["tensors", 0, 2], [-4, 8]),
    "unknown dtype": _set(["tensors", 0, 1], "F128"),
    "entry missing its checksum": _sent(lambda m: m["tensors"][0].pop()),
    "a module tensor the live state lacks": _lacked("model/huge", [1 << 30]),
    "optimizer state past its parameters": _lacked("optim/state/0/huge", [1 << 30]),
}


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optim": optim, "progress": {"step": 0}}


def _hostile_source_job(rank: int, world: int, job: str) -> list[Any]:
    """Rank 0 is live at step 1 and speaks the heal's protocol by hand, sending each
    `HOSTILE` description; rank 1, a replacement, heals with the real `live.heal`. Then
    rank 0 heals rank 1 honestly, over the same group."""
    from unbroken.job.comm import Comm

    comm = Comm(None, timedelta(seconds=30))
    state = _state()
    if rank == 0:  # one step: the replacement lacks the optimizer's state
        state["model"](torch.ones(2, 8)).sum().backward()
        state["optim"].step()
    before = [t.clone() for t in state["model"].state_dict().values()]
    results = []
    for case in HOSTILE:  # deep nesting first: what fails first on unchecked code
        try:
            if rank == 0:
                _lie(comm, state, HOSTILE[case])
            else:
                live.heal(comm, f"{job}-{case}", state, capture(state))
            results.append((case, "healed", ""))
        except CheckpointError as e:  # anything else fails the rank, and so the test
            results.append((case, "refused", str(e)))
    untouched = all(
        torch.equal(a, b) for a, b in zip(before, state["model"].state_dict().values(), strict=True)
    ) and (rank == 0 or not state["optim"].state)
    if rank == 0:
        records.keep_own(job, Record.make(1, 0, state, layouts={}, data_parallel=True))
        records.keep_held(job, 1, 1, Record.make(1, 1, state).data)
    healed = live.heal(comm, job, state, capture(state))
    sums = [float(t.sum()) for t in state["model"].state_dict().values()]
    return [results, untouched, None if healed is None else healed[0].step, sums]


def _lie(comm: Any, state: dict[str, Any], change: Change) -> None:
    """The source's side of `live.heal`, with a description changed by ``change``."""
    comm.all_gather({"live": 1, "held": {"1": [1]}, "peers": None})
    meta = live._meta(replicated_entries(state, capture(state)))
    data = change(meta)
    comm.all_gather([meta.get("digest", "0" * 16), None])
    parts = [Record.make(1, 1, state).data, data]
    framed = b"".join(len(p).to_bytes(8, "little") + p for p in parts)
    records.exchange(comm, {1: framed}, [])
    comm.together("checking the heal of step 1", lambda: None)


@pytest.mark.timeout(120)
def test_a_hostile_source_is_refused_on_every_rank_and_changes_nothing(tmp_path):
    source, lost = run_ranks(_hostile_source_job, "hostile", timeout=100)
    for (case, outcome, message), (_, theirs, echoed) in zip(lost[0], source[0], strict=True):
        assert outcome == theirs == "refused", (case, message)
        assert "rank 0" in message and "step 1" in message, (case, message)
        assert "rank 1" in echoed, (case, echoed)  # the source learns why, from rank 1
    by_case = {case: message for case, _, message in lost[0]}
    assert "nests too deeply" in by_case["deep nesting"]
    assert "not allocated" in by_case["optimizer state past its parameters"]
    assert "one side only" in by_case["a module tensor the live state lacks"]
    assert lost[1] and source[1]  # nothing changed on either rank
    assert lost[2] == source[2] == 1 and lost[3] == source[3]  # an honest heal still works


# -- the live replica's description, unit by unit -----------------------------------------


def _honest() -> tuple[dict[str, Any], dict[str, Any]]:
    """A trained source's description, and a fresh replacement's state."""
    source = _state()
    source["model"](torch.ones(2, 8)).sum().backward()
    source["optim"].step()
    return live._meta(replicated_entries(source, capture(source))), _state()


def _targets(meta: dict[str, Any], data: bytes, state: dict[str, Any]) -> dict[str, Any]:
    from unbroken.healing import messages

    described = messages.meta(data, 3, 9, meta["digest"])
    shared = replicated_entries(state, capture(state))
    return live._targets(state, shared, described, Record.make(9, 1, state))[0]


def test_an_honest_description_fits_a_fresh_replacement_within_its_bounds():
    meta, state = _honest()
    targets = _targets(meta, json.dumps(meta).encode(), state)
    assert set(targets) == {key for key, *_ in meta["tensors"]}
    weight = state["model"][0].weight
    assert targets["model/0.weight"].data_ptr() == weight.data_ptr()  # received in place
    assert targets["optim/state/0/exp_avg"].shape == (4, 8)  # allocated: the state lacks it


def _omit(meta: dict[str, Any]) -> None:
    key = meta["tensors"].pop(0)[0]  # model/0.bias, from the table and the tree
    del meta["tree"]["model"][key.split("/", 1)[1]]


MORE: dict[str, Change] = {
    **HOSTILE,
    "not JSON": lambda m: b"\xff{",
    "not an object": lambda m: b"[1]",
    "a table other than the one agreed": lambda m: json.dumps(
        {**m, "tensors": [[*e[:3], "0" * 16] for e in m["tensors"]]}
    ).encode(),
    "nesting past what decoding takes": _set(
        ["tree", "model", "deep"], json.loads("[" * 150 + "]" * 150)
    ),
    "placeholder for no listed tensor": _set(["tree", "model", "0.weight"], {"__tensor__": "x"}),
    "placeholder not a string": _set(["tree", "model", "0.weight"], {"__tensor__": [1]}),
    "malformed mapping": _set(["tree", "optim", "state"], {"__items__": [[0]]}),
    "malformed tuple": _set(["tree", "optim", "param_groups"], {"__tuple__": 5}),
    "listed tensor placed nowhere": _set(["tree", "model"], {}),
    "a key listed twice": _sent(lambda m: m["tensors"].append(list(m["tensors"][0]))),
    "absurd shape": _set(["tensors", 0, 2], [1 << 40, 1 << 40]),
    "too many dimensions": _set(["tensors", 0, 2], [1] * 65),
    "a boolean size": _set(["tensors", 0, 2], [True, 8]),
    "a name that is not a string": _set(["tensors", 0, 0], 7),
    "a module tensor it omits": _sent(_omit),
}


@pytest.mark.parametrize("case", sorted(MORE))
def test_a_malformed_description_is_refused_naming_the_rank_before_any_allocation(case):
    meta, state = _honest()
    digest = meta["digest"]
    data = MORE[case](meta)
    meta.setdefault("digest", digest)
    weights = [t.clone() for t in state["model"].parameters()]
    with pytest.raises(CheckpointError, match="rank 3") as error:
        _targets(meta, data, state)
    assert "Traceback" not in str(error.value) and not state["optim"].state
    assert all(torch.equal(a, b) for a, b in zip(weights, state["model"].parameters(), strict=True))


# -- the plan's rows and a peer's step record ---------------------------------------------


def _row(**change: Any) -> dict[str, Any]:
    return {"live": 4, "held": {"1": [3, 4]}, "peers": None, **change}


ROWS: dict[str, Any] = {
    "not an object": [1],
    "live not a step": _row(live="4"),
    "live negative": _row(live=-1),
    "held not an object": _row(held=[1]),
    "held of no rank": _row(held={"x": [4]}),
    "held of a rank past the world": _row(held={"9": [4]}),
    "held steps not a list": _row(held={"1": 4}),
    "held step a list": _row(held={"1": [[4]]}),
    "peers not ranks": _row(peers=["0"]),
    "peers past the world": _row(peers=[0, 7]),
    "missing keys": {},
}


@pytest.mark.parametrize("case", sorted(ROWS))
def test_a_malformed_plan_row_is_refused_naming_its_rank(case):
    from unbroken.healing import messages

    table = [_row(held={}), ROWS[case]]
    with pytest.raises(CheckpointError, match="rank 1 sent a malformed heal plan row"):
        plan.plan(messages.rows(table, 2))
    assert plan.plan(messages.rows([_row(), _row(live=None, held={})], 2)) is not None


def _record(tree: Any = None, table: Any = None) -> bytes:
    """A real step record, its tree and table replaced (its checksum still holds)."""
    data = Record.make(7, 1, {"rng": {"seen": torch.arange(6.0)}}).data
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + size])
    header["tree"] = header["tree"] if tree is None else tree
    header["tensors"] = header["tensors"] if table is None else table
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + size :]


_SEEN = {"__tensor__": "rng/seen"}
RECORDS: dict[str, bytes] = {
    "tree nests past what decoding takes": _record(
        {"rng": {"seen": _SEEN, "deep": json.loads("[" * 150 + "]" * 150)}}
    ),
    "placeholder for no listed tensor": _record({"rng": {"seen": {"__tensor__": "rng/x"}}}),
    "placeholder not a string": _record({"rng": {"seen": {"__tensor__": [1]}}}),
    "malformed mapping": _record({"rng": {"seen": _SEEN, "m": {"__items__": [[{}, 1]]}}}),
    "malformed tuple": _record({"rng": {"seen": _SEEN, "t": {"__tuple__": 5}}}),
    "listed tensor placed nowhere": _record({"rng": {}}),
    "a key listed twice": _record(table=[["rng/seen", "F32", [3]], ["rng/seen", "F32", [3]]]),
}


@pytest.mark.parametrize("case", sorted(RECORDS))
def test_a_record_whose_tree_decoding_would_fail_is_refused_on_arrival(case):
    with pytest.raises(CheckpointError, match="rank 1"):
        Record.decode(RECORDS[case], "rank 1")


def test_a_record_of_every_form_the_encoding_makes_decodes():
    state = {"s": {"t": (1, torch.ones(2)), "m": {0: [torch.zeros(3)]}, "n": None}}
    got = Record.decode(Record.make(2, 0, state).data, "rank 0")
    assert set(got.tensors()) == {"s/t/1", "s/m/0/0"}


# -- DDP layouts: a shared-memory file and a peer's record ---------------------------------

LAYOUTS: dict[str, Callable[[str], str]] = {
    "deep nesting": lambda job: "[" * 100_000 + "]" * 100_000,
    "not an object": lambda job: "[1, 2]",
    "not JSON": lambda job: "{",
    "layouts not an object": lambda job: json.dumps({"job": job, "layouts": [[0, 1]]}),
    "a layout not buckets": lambda job: json.dumps({"job": job, "layouts": {"model": 5}}),
    "a bucket of strings": lambda job: json.dumps({"job": job, "layouts": {"model": [["0"]]}}),
    "an index past the parameters": lambda job: json.dumps(
        {"job": job, "layouts": {"model": [[0, 1, 2]]}}
    ),
    "an entry that is no module": lambda job: json.dumps(
        {"job": job, "layouts": {"progress": [[0]]}}
    ),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_a_malformed_layouts_file_is_ignored_with_a_warning_and_the_restore_succeeds(
    tmp_path, caplog, case
):
    import os

    from unbroken import Checkpointer

    torch.manual_seed(0)
    state: dict[str, Any] = {"model": nn.Linear(4, 2), "progress": {"step": 3}}
    saved = [t.clone() for t in state["model"].parameters()]
    ckpt = Checkpointer(tmp_path / "ck", memory=True, memory_dir=str(tmp_path / "shm"), job="j")
    try:
        ckpt.save(3, state)
        ckpt.wait()
        assert ckpt._memory is not None
        path = os.path.join(ckpt._memory.dir, "ddp-layouts.json")
        with open(path, "w") as f:
            f.write(LAYOUTS[case](ckpt._stepper.job))
        with torch.no_grad():
            for p in state["model"].parameters():
                p.zero_()
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            assert ckpt.restore(state) == 3
    finally:
        ckpt.close()
    assert all(torch.equal(a, b) for a, b in zip(saved, state["model"].parameters(), strict=True))
    assert f"ignoring {path}" in caplog.text


@pytest.mark.parametrize("layouts", [[[0, 1]], {"model": 5}, {"model": [[0, 0]]}, {"x": [[0]]}])
def test_malformed_layouts_in_a_peers_record_are_ignored_with_a_warning(caplog, layouts):
    from unbroken.healing.stepper import Stepper
    from unbroken.job.comm import Comm

    job = f"layouts-{json.dumps(layouts)}"
    state = {"model": nn.Linear(4, 2), "progress": {"step": 5}}
    records.keep_held(job, 1, 5, Record.make(5, 1, state, layouts=layouts).data)
    stepper = Stepper(Comm(None, timedelta(seconds=5)), job, [], [])
    try:
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            stepper.restored(5, state, None)
    finally:
        stepper.stop()
        records.forget(job)
    assert "ignoring the DDP layouts in rank 1's step record of step 5" in caplog.text


def test_layouts_are_checked_against_the_modules_they_name():
    from unbroken.healing import ddp_buckets

    state = {"model": nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 1)), "n": 1}
    assert ddp_buckets.check_layouts({"model": [[3, 2], [1, 0]]}, state) == {
        "model": [[3, 2], [1, 0]]
    }
    bad: list[Any] = [{"model": [[0, 1, 2, 3, 4]]}, {"model": [[]]}, {"n": [[0]]}, [[0]]]
    for layouts in bad:
        with pytest.raises(ValueError):
            ddp_buckets.check_layouts(layouts, state)
