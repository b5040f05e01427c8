import json

import pytest
import torch
from safetensors import safe_open

from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.layout import Chunk, Manifest, TensorEntry, joined, parse_step_dir, step_dir
from unbroken.format.write_plan import Block, make_plan, survey


def _manifest(**changes):
    m = Manifest(
        step=12,
        world_size=2,
        created=1.5,
        tensors={
            "w": TensorEntry(
                dtype="BF16",
                shape=[4, 2],
                chunks=[Chunk(offsets=[0, 0], shape=[4, 2], file="f", start=8, end=24, xxh3="ab")],
            )
        },
        objects=[{"p": {"step": 12}}],
        rank_objects=[0, 0],
        files={"f": 24},
    )
    for k, v in changes.items():
        setattr(m, k, v)
    return m


def test_manifest_roundtrips_through_json():
    m = _manifest()
    back = Manifest.from_json(m.to_json(), "x")
    assert back == m
    assert back.objects_for(1) == {"p": {"step": 12}}
    assert back.tensors["w"].torch_dtype is torch.bfloat16


def test_manifest_from_a_newer_version_is_refused_with_advice():
    with pytest.raises(CheckpointError, match=r"format version 99, newer .* upgrade unbroken"):
        Manifest.from_json(_manifest(version=99).to_json(), "x/manifest.json")


@pytest.mark.parametrize(
    "data",
    [b"{not json", b'{"format": "other"}', b'{"format": "unbroken-checkpoint", "version": 1}'],
)
def test_malformed_manifests_are_corrupt(data):
    with pytest.raises(CorruptCheckpointError, match=r"x/manifest\.json"):
        Manifest.from_json(data, "x/manifest.json")


def test_step_dirs_sort_and_parse():
    assert step_dir(1200) == "step-000001200"
    assert parse_step_dir("step-000001200") == 1200
    assert parse_step_dir("step-12") is None and parse_step_dir("step-000001200.tmp") is None
    assert sorted([step_dir(10), step_dir(9)]) == [step_dir(9), step_dir(10)]


def test_shard_files_are_readable_by_safetensors(tmp_path):
    import unbroken

    state = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.ones(2, dtype=torch.bfloat16),
    }
    unbroken.Checkpointer(tmp_path).save(1, state)
    files = list((tmp_path / step_dir(1)).glob("*.safetensors"))
    assert len(files) == 1
    with safe_open(files[0], "pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]
        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            assert torch.equal(f.get_tensor(key), state[key])


def _block(key, xxh3, nbytes=100, offsets=(0,), shape=(10,), local=(10,), alias_of=None):
    return Block(
        alias_of=alias_of,
        key=key,
        dtype="F32",
        shape=shape,
        offsets=offsets,
        local_shape=local,
        nbytes=nbytes,
        xxh3=xxh3,
    )


@pytest.mark.parametrize(
    ("blocks", "writers", "tagged"),
    [
        # Replicated on both ranks: written once each, spread by size over the two ranks.
        (
            [[_block("a", "1", 300), _block("b", "2", 200), _block("c", "3", 100)]] * 2,
            {"a": 0, "b": 1, "c": 1},
            {},
        ),
        # Different values on each rank: each written by its own rank, tagged with it.
        ([[_block("r", "x")], [_block("r", "y")]], {"r": None}, {"r": [[0], [1]]}),
        # Row shards of one tensor: each rank writes its own region, untagged.
        (
            [
                [_block("s", "x", offsets=(0,), shape=(20,))],
                [_block("s", "y", offsets=(10,), shape=(20,))],
            ],
            {"s": None},
            {"s": [None, None]},
        ),
        # A tensor only rank 1 holds.
        ([[], [_block("only", "z")]], {"only": 1}, {}),
    ],
)
def test_plan_writes_each_distinct_block_once(blocks, writers, tagged):
    plan = _plan(blocks)
    written = [key for keys in plan.writes for key in keys]
    distinct = {(b.key, b.offsets, b.xxh3) for rank in blocks for b in rank}
    assert len(written) == len(distinct)
    for key, rank in writers.items():
        if rank is not None:
            assert key in plan.writes[rank]
    for key, ranks in tagged.items():
        writers_of = [r for r, keys in enumerate(plan.writes) if key in keys]
        assert [plan.tags[r].get(key) for r in writers_of] == ranks


def _plan(blocks):
    """The plan of ``blocks`` as rank 0 makes it: from their rows as they arrive (JSON)."""
    rows = json.loads(json.dumps([[b.to_json() for b in rank] for rank in blocks]))
    return make_plan(survey(rows), [{} for _ in blocks])


def test_plan_refuses_keys_whose_shape_differs_between_ranks():
    with pytest.raises(
        CheckpointError, match="'w' is F32\\[10\\] on rank 0 but F32\\[12\\] on rank 1"
    ):
        _plan([[_block("w", "1")], [_block("w", "1", shape=(12,), local=(12,))]])


def test_plan_stores_a_tied_tensor_once_only_where_every_holder_ties_it():
    tied = [_block("wte", "1"), _block("head", "1", alias_of="wte")]
    plan = _plan([tied, tied])
    assert sorted(k for keys in plan.writes for k in keys) == ["wte"]
    assert plan.aliases == {"head": "wte"}
    assert list(plan.tensors) == ["wte", "head"]  # a tied key last, stored as its original
    # Rank 1 holds the two as separate tensors (equal bytes): stored as usual.
    plan = _plan([tied, [_block("wte", "1"), _block("head", "1")]])
    assert sorted(k for keys in plan.writes for k in keys) == ["head", "wte"]
    assert plan.aliases == {}


def test_a_manifest_joined_from_its_writers_chunks_is_the_one_to_json_writes():
    """A save's manifest is joined from the chunks each writer encoded: the same bytes."""
    chunks = [
        Chunk(offsets=[0, 0], shape=[4, 2], file="r00000-000.safetensors", start=8, end=24,
              xxh3="ab", ranks=[0, 2], pieces=["a", "b"], piece_bytes=8),
        Chunk(offsets=[0, 0], shape=[4, 2], file="r00001-000.safetensors", start=8, end=24,
              xxh3="cd", ranks=[1]),
    ]  # fmt: skip
    m = _manifest()
    m.tensors['caf\u00e9/"q"'] = TensorEntry(dtype="F32", shape=[4, 2], chunks=chunks)
    m.objects = [{"z": 1, "a": "\u00e9"}]
    texts = {key: [c.to_text() for c in e.chunks] for key, e in m.tensors.items()}
    bare = {k: TensorEntry(dtype=e.dtype, shape=e.shape) for k, e in m.tensors.items()}
    header = Manifest(step=m.step, world_size=m.world_size, created=m.created, tensors=bare,
                      objects=m.objects, rank_objects=m.rank_objects, files=m.files)  # fmt: skip
    encoded = joined(header, texts)
    assert encoded.data == m.to_json()
    assert encoded.step == 12 and encoded.to_json() is encoded.data
