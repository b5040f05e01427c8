"""Hostile input that other processes hand a restore: a live-healing record from a peer,
and a shared-memory slot's description. Checked whole before use; anything malformed is
a clean error (tests/test_hostile.py covers manifests, pointers and headers)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_hostile import FUZZ, good, json_values
from unbroken.errors import CheckpointError
from unbroken.format.layout import Manifest

# -- live-healing records from a peer ----------------------------------------------------


def _record_bytes(header_change: Callable[[dict[str, Any]], None] | None = None) -> bytes:
    """A real step record (per-rank tensors and a JSON tree), its header changed."""
    import struct

    import torch

    from unbroken.healing.records import Record

    state = {"rng": {"seen": torch.arange(6, dtype=torch.float32)}, "note": {"epoch": 3}}
    record = Record.make(7, 1, state, layouts={})
    if header_change is None:
        return record.data
    (size,) = struct.unpack_from("<Q", record.data)
    header = json.loads(record.data[8 : 8 + size])
    header_change(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + record.data[8 + size :]


def _field(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        target = header
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return change


RECORD_CASES = {
    "huge shape": _field(["tensors", 0, 2], [1 << 40, 1 << 40]),
    "shape past the payload": _field(["tensors", 0, 2], [7]),
    "negative dim": _field(["tensors", 0, 2], [-6]),
    "unknown dtype": _field(["tensors", 0, 1], "float128"),
    "entry not a triple": _field(["tensors", 0], "rng/seen"),
    "tree not an object": _field(["tree"], []),
    "step not a number": _field(["step"], "7"),
    "no checksum": lambda h: h.pop("xxh3"),
    "deep nesting": _field(["tree", "deep"], json.loads("[" * 50 + "]" * 50)),
}


def test_a_real_record_decodes() -> None:
    from unbroken.healing.records import Record

    record = Record.decode(_record_bytes(), "rank 1")
    assert record.step == 7 and list(record.tensors()["rng/seen"].tolist()) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("case", sorted(RECORD_CASES))
def test_a_tampered_record_is_refused_before_anything_is_allocated(case: str) -> None:
    from unbroken.healing.records import Record

    data = _record_bytes(RECORD_CASES[case])
    if case == "deep nesting":  # well-formed JSON, only deep: fine if the checksum holds
        Record.decode(data, "rank 1").tensors()
        data = data.replace(b"[" * 50, b"[" * 100_000).replace(b"]" * 50, b"]" * 100_000)
    with pytest.raises(CheckpointError, match="rank 1"):
        Record.decode(data, "rank 1")


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzed_records_fail_cleanly(data: st.DataObject) -> None:
    """A record whose header field is any JSON value, or whose bytes are cut or flipped:
    decoded whole (and its tensors then read) or CheckpointError, nothing else."""
    from unbroken.healing.records import Record

    key = data.draw(st.sampled_from(["step", "rank", "tree", "tensors", "xxh3", "extra"]))
    raw = bytearray(_record_bytes(_field([key], data.draw(json_values))))
    if data.draw(st.booleans()) and raw:
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    with contextlib.suppress(CheckpointError):
        Record.decode(bytes(raw), "rank 1").tensors()


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzed_snapshot_descriptions_fail_cleanly(data: st.DataObject) -> None:
    """A shared-memory slot's description with any field replaced by any JSON value, or
    arbitrary bytes: read (and its manifest parsed) or ValueError/CheckpointError only."""
    from unbroken.format.validate import snapshot_description

    good_manifest = json.dumps(good())
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=200))
    else:
        fields: dict[str, Any] = {"job": "j", "rank": 0, "manifest": good_manifest}
        fields[data.draw(st.sampled_from([*fields, "extra"]))] = data.draw(json_values)
        raw = json.dumps(fields).encode()
    with contextlib.suppress(ValueError, CheckpointError):
        _, _, text = snapshot_description(raw)
        Manifest.from_json(text, "slot-0.json")


def _claims_a_huge_record(rank: int, world: int) -> str:
    """Rank 1 says its step record is 1 TiB; rank 0 must refuse it before allocating."""
    from datetime import timedelta

    import torch

    from unbroken.healing import records
    from unbroken.job.comm import Comm

    comm = Comm(None, timedelta(seconds=30))
    if rank == 1:
        first = bytearray(records.FIRST)
        first[:8] = (1 << 40).to_bytes(8, "little")
        into = torch.empty(records.FIRST, dtype=torch.uint8)
        records._run(comm, {0: torch.frombuffer(first, dtype=torch.uint8)}, {0: into})
        return "sent"
    with pytest.raises(CheckpointError, match=r"rank 1 sent a step record of \d+ bytes") as e:
        records.exchange(comm, {1: b"r" * 1000}, [1])
    return str(e.value)


@pytest.mark.timeout(60)
def test_a_peer_claiming_a_huge_step_record_is_refused_before_allocating() -> None:
    from ranks import run_ranks

    refused, sent = run_ranks(_claims_a_huge_record)
    assert sent == "sent" and "not allocated" in refused, refused
