"""Hostile manifests: every tampered field gives a clean CorruptCheckpointError naming it,
before anything is read or allocated (issue 17, item 5)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.layout import FORMAT, Manifest
from unbroken.format.validate import stored_enough

FUZZ = int(os.environ.get("UNBROKEN_FUZZ_EXAMPLES", "300"))


def good(chunks: int = 2) -> dict[str, Any]:
    """A valid manifest: tensor 'w' (F32, [2*chunks, 4]) in one file, one block per 2 rows."""
    blocks = [
        {"offsets": [2 * i, 0], "shape": [2, 4], "file": "r00000-000.safetensors",
         "start": 32 * i, "end": 32 * i + 32, "xxh3": "0123456789abcdef"}
        for i in range(chunks)
    ]  # fmt: skip
    return {
        "format": FORMAT, "version": 2, "step": 7, "world_size": 2, "created": 1.0,
        "tensors": {"w": {"dtype": "F32", "shape": [2 * chunks, 4], "chunks": blocks}},
        "objects": [{"a": 1}], "rank_objects": [0, 0],
        "files": {"r00000-000.safetensors": 32 * chunks},
    }  # fmt: skip


def parse(raw: Any) -> Manifest:
    return Manifest.from_json(json.dumps(raw).encode(), "m.json")


def chunk0(m: dict[str, Any]) -> dict[str, Any]:
    return m["tensors"]["w"]["chunks"][0]


def _set(path: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Callable:
    def edit(m: dict[str, Any]) -> None:
        path(m)[key] = value

    return edit


def root(m: dict[str, Any]) -> dict[str, Any]:
    return m


def tensor(m: dict[str, Any]) -> dict[str, Any]:
    return m["tensors"]["w"]


CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "huge global shape": (_set(tensor, "shape", [1 << 40, 1 << 40]), "absurdly large"),
    "global shape past its blocks": (_set(tensor, "shape", [1 << 30, 4]), "do not cover"),
    "one range for two blocks": (
        lambda m: m["tensors"]["w"]["chunks"][1].update(start=0, end=32),
        "two blocks claim",
    ),
    "huge block shape": (_set(chunk0, "shape", [1 << 40, 4]), "outside shape"),
    "negative shape": (_set(tensor, "shape", [-4, 4]), "shape"),
    "block outside tensor": (_set(chunk0, "offsets", [3, 0]), "outside shape"),
    "wrong ndim": (_set(chunk0, "offsets", [0]), "dimensions"),
    "negative start": (_set(chunk0, "start", -32), "start"),
    "reversed range": (lambda m: chunk0(m).update(start=32, end=0), "end"),
    "range past file": (_set(chunk0, "end", 1 << 40), "end"),
    "range not block size": (_set(chunk0, "end", 16), "do not hold"),
    "overlapping ranges": (
        lambda m: (
            chunk0(m).update(start=16, end=48) or m["files"].update({"r00000-000.safetensors": 64})
        ),
        "overlap",
    ),
    "dotdot file": (_set(chunk0, "file", "../../etc/passwd"), "plain file name"),
    "absolute file": (_set(chunk0, "file", "/etc/passwd"), "plain file name"),
    "separator file": (_set(chunk0, "file", "a/b"), "plain file name"),
    "dotdot in files": (lambda m: m["files"].update({"..": 1}), "plain file name"),
    "unlisted file": (_set(chunk0, "file", "r00001-000.safetensors"), "does not list"),
    "absurd world size": (_set(root, "world_size", 1 << 40), "world_size"),
    "absurd step": (_set(root, "step", 1 << 80), "step"),
    "string step": (_set(root, "step", "7"), "step"),
    "bool step": (_set(root, "step", True), "step"),
    "absurd objects": (_set(root, "objects", [{}] * 3), "objects"),
    "absurd ranks": (_set(root, "rank_objects", [0] * 1000), "rank_objects"),
    "absurd dims": (_set(tensor, "shape", [1] * 1000), "at most"),
    "unknown dtype": (_set(tensor, "dtype", "F128"), "unknown dtype"),
    "unknown chunk field": (_set(chunk0, "__class__", "os.system"), "unknown fields"),
    "rank object nowhere": (_set(root, "rank_objects", [0, 5]), r"rank_objects\[1\]"),
    "chunk rank nowhere": (_set(chunk0, "ranks", [9]), "chunk rank"),
    "missing tensors": (lambda m: m.pop("tensors"), "tensors"),
    "tensors a list": (_set(root, "tensors", []), "tensors"),
    "chunk a string": (_set(tensor, "chunks", ["x"]), "chunk"),
    "bad checksum field": (_set(chunk0, "xxh3", 5), "checksum"),
    "bad pieces": (_set(chunk0, "pieces", [1, 2]), "piece"),
}


def test_good_manifest_parses() -> None:
    manifest = parse(good())
    assert manifest.tensors["w"].chunks[1].start == 32 and manifest.objects_for(1) == {"a": 1}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tampered_manifest_is_refused_naming_the_field(case: str) -> None:
    raw = good()
    edit, words = CASES[case]
    edit(raw)
    with pytest.raises(CorruptCheckpointError, match=words) as info:
        parse(raw)
    assert "m.json" in str(info.value)


@pytest.mark.parametrize(
    "data", [b"[" * 100_000, b"\xff\xfe\x00garbage", b'{"format": "\xc3\x28"}', b"", b"null"]
)
def test_deep_nesting_and_bad_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"m\.json"):
        Manifest.from_json(data, "m.json")


def test_validation_is_linear_and_as_cheap_as_parsing() -> None:
    """100k chunks parse and validate in a few times what ``json.loads`` takes for the
    same text (best of three each, side by side: a loaded machine slows both): nothing
    in validation grows faster than the manifest."""

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        return min(times)

    text = json.dumps(good(100_000)).encode()
    manifest = Manifest.from_json(text, "m.json")
    assert len(manifest.tensors["w"].chunks) == 100_000
    took, parse = best(lambda: Manifest.from_json(text, "m.json")), best(lambda: json.loads(text))
    print(f"100k-chunk manifest: {took:.3f} s to parse and validate, json.loads {parse:.3f} s")
    assert took < 10 * parse


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
FIELDS = ["step", "world_size", "created", "tensors", "objects", "rank_objects", "files"]


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzed_manifests_fail_cleanly(data: st.DataObject) -> None:
    """Any field of a valid manifest replaced by any JSON value: parses or CheckpointError."""
    raw = copy.deepcopy(good())
    where = data.draw(st.sampled_from(["root", "tensor", "chunk"]))
    target = {"root": raw, "tensor": tensor(raw), "chunk": chunk0(raw)}[where]
    key = data.draw(st.sampled_from([*sorted(target), "extra"]))
    target[key] = data.draw(json_values)
    with contextlib.suppress(CheckpointError):
        parse(raw)


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200))
def test_fuzzed_bytes_fail_cleanly(data: bytes) -> None:
    with contextlib.suppress(CheckpointError):
        Manifest.from_json(data, "m.json")


def _escape(m: dict[str, Any]) -> None:
    """Point a block at a file outside the checkpoint, sized so only the name is wrong."""
    for entry in m["tensors"].values():
        for c in entry["chunks"]:
            c["file"] = "../../outside"
    m["files"] = {"../../outside": max(m["files"].values())}


def _huge(m: dict[str, Any]) -> None:
    m["tensors"]["ema"]["shape"] = [1 << 40]
    m["tensors"]["ema"]["chunks"][0]["shape"] = [1 << 40]


def _overrun(m: dict[str, Any]) -> None:
    m["tensors"]["ema"]["chunks"][0]["end"] += 1 << 30


TAMPER = {"escape": (_escape, "plain file name"), "huge": (_huge, "ema"),
          "overrun": (_overrun, "ema")}  # fmt: skip


@pytest.mark.parametrize("how", sorted(TAMPER))
def test_a_tampered_checkpoint_leaves_the_state_and_other_files_alone(tmp_path, how: str) -> None:
    """Save steps 1 and 2, tamper step 2's manifest: restoring step 2 raises naming the step
    and the problem, changes no live tensor and reads nothing outside the checkpoint; a
    restore of the newest step falls back to step 1."""
    import torch

    from unbroken import Checkpointer
    from unbroken.format.layout import MANIFEST, step_dir

    outside = tmp_path / "outside"
    outside.write_bytes(b"secret" * 100)
    before = outside.stat()
    ckpt = Checkpointer(tmp_path / "a" / "ckpt")
    state = {"ema": torch.arange(8.0), "w": torch.ones(3, 5)}
    for step in (1, 2):
        state["ema"].add_(1)
        ckpt.save(step, state)
    path = tmp_path / "a" / "ckpt" / step_dir(2) / MANIFEST
    raw = json.loads(path.read_bytes())
    edit, words = TAMPER[how]
    edit(raw)
    path.write_bytes(json.dumps(raw).encode())
    live = {"ema": torch.full((8,), -1.0), "w": torch.zeros(3, 5)}
    with pytest.raises(CheckpointError, match=words) as info:
        ckpt.restore(live, step=2)
    assert step_dir(2) in str(info.value)
    assert torch.equal(live["ema"], torch.full((8,), -1.0)) and not live["w"].any()
    after = outside.stat()
    assert (after.st_atime_ns, after.st_mtime_ns) == (before.st_atime_ns, before.st_mtime_ns)
    assert ckpt.restore(live) == 1 and torch.equal(live["ema"], torch.arange(8.0) + 1)
    ckpt.close()


def test_tensor_not_live_is_not_allocated_beyond_its_stored_bytes() -> None:
    """Defence in depth behind the schema's coverage rule: restore's own check refuses an
    entry whose shape needs more bytes than its blocks store."""
    raw = good()
    raw["tensors"]["big"] = {"dtype": "F32", "shape": [1 << 20, 1 << 20], "chunks": []}
    with pytest.raises(CorruptCheckpointError, match="cover"):
        parse(raw)  # the schema refuses it first
    with pytest.raises(CorruptCheckpointError, match=r"'big'.*not allocated"):
        stored_enough("big", "F32", [1 << 20, 1 << 20], [], "m.json")
    w = parse(good()).tensors["w"]
    stored_enough("w", w.dtype, w.shape, w.chunks, "m.json")  # fully stored: allowed


POINTERS = [b"[" * 100_000, b"\xff\xfe", b'{"step": "../../etc"}', b'{"step": -3}',
            b'{"step": 1e400}', b'{"step": true}', b"[2]", b'{"step": 99}']  # fmt: skip
INFOS = [b"[" * 100_000, b"\xc3\x28", b'{"created": "x"}', b'{"created": Infinity}',
         b'{"created": 1.0, "metric": [1]}', b"7"]  # fmt: skip


@pytest.fixture
def two_steps(tmp_path):
    """Steps 1 and 2 saved with a metric; the Directory over them."""
    import torch

    from unbroken import Checkpointer
    from unbroken.format.directory import Directory
    from unbroken.storage import open_storage

    ckpt = Checkpointer(tmp_path / "ckpt")
    for step in (1, 2):
        ckpt.save(step, {"t": torch.ones(2) * step}, metric=float(step))
    ckpt.close()
    return tmp_path / "ckpt", Directory(open_storage(str(tmp_path / "ckpt")), "ckpt")


@pytest.mark.parametrize("data", POINTERS)
def test_a_hostile_latest_pointer_is_ignored_for_the_listing(two_steps, data: bytes) -> None:
    path, directory = two_steps
    (path / "latest").write_bytes(data)
    assert directory.latest() == 2


@pytest.mark.parametrize("data", INFOS)
def test_a_hostile_info_file_falls_back_to_the_manifest(two_steps, data: bytes) -> None:
    from unbroken.format.layout import step_dir
    from unbroken.saving.committed import INFO, read_info

    path, directory = two_steps
    assert read_info(directory, 2).metric == 2.0
    (path / step_dir(2) / INFO).write_bytes(data)
    info = read_info(directory, 2)
    assert info.metric is None and info.created == directory.manifest(2).created


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=1 << 20))
def test_fuzzed_safetensors_headers_fail_cleanly(data: bytes, size: int) -> None:
    """Any bytes as a shard's header, any file size: ranges inside the file, or
    CheckpointError naming the shard."""
    from unbroken.format.validate import header_ranges

    try:
        ranges = header_ranges(data, size, "s.safetensors")
    except CheckpointError as e:
        assert "s.safetensors" in str(e)
    else:
        assert all(0 <= start <= end <= size for start, end in ranges)


def test_a_real_header_lists_its_blocks() -> None:
    import torch

    from unbroken.format.layout import safetensors_header
    from unbroken.format.validate import header_ranges

    header = safetensors_header([("a", torch.float32, [2, 3], 24), ("b", torch.int8, [5], 5)])
    size = len(header) + 29
    assert header_ranges(header, size, "s") == {(len(header), len(header) + 24),
                                                (len(header) + 24, size)}  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match="safetensors header"):
        header_ranges(header, size - 1, "s")
