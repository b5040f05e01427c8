"""The contract every storage backend passes: local, S3 (a real moto server), fsspec."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.errors import CheckpointError
from unbroken.format.coalesce import SLIVER, Extent, Rules, fetch, plan
from unbroken.storage import Storage, open_storage


@pytest.fixture(params=["local", "s3", "memory", pytest.param("rgw", marks=pytest.mark.rgw)])
def storage(request, tmp_path) -> Storage:
    """Local disk, S3 on moto's server, fsspec's memory file system, S3 on Ceph RGW."""
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    if request.param in ("s3", "rgw"):
        uri, options = request.getfixturevalue("bucket" if request.param == "s3" else "rgw_bucket")
        return open_storage(uri, options)
    return open_storage(f"memory://{tmp_path.name}/root")


def test_write_then_read_back(storage):
    storage.write("d/f", [b"head", memoryview(b"body")])
    assert storage.read("d/f") == b"headbody"
    assert storage.size("d/f") == 8
    out = bytearray(3)
    storage.read_into("d/f", 2, memoryview(out))
    assert out == b"adb"


def test_a_large_object_round_trips_in_parts(storage):
    data = bytes(range(256)) * (48 << 12)  # 12 MiB: several 5 MiB parts on S3
    storage.write("big", [data[:1000], memoryview(data)[1000:]])
    out = bytearray(len(data) - 7)
    storage.read_into("big", 7, memoryview(out))
    assert out == data[7:]


def test_read_past_the_end_is_eof(storage):
    storage.write("f", [b"abc"])
    with pytest.raises(EOFError):
        storage.read_into("f", 1, memoryview(bytearray(5)))


def test_missing_files_are_file_not_found(storage):
    with pytest.raises(FileNotFoundError):
        storage.size("nope")
    with pytest.raises(FileNotFoundError):
        storage.read("nope")
    assert storage.list("nope") == []


def test_commit_creates_once_and_never_replaces(storage):
    storage.commit("d/m", b"first")
    with pytest.raises(FileExistsError):
        storage.commit("d/m", b"second")
    assert storage.read("d/m") == b"first"
    assert storage.list("d") == ["m"]  # no temporary left behind


def test_replace_overwrites(storage):
    storage.replace("p", b"1")
    storage.replace("p", b"22")
    assert storage.read("p") == b"22"


def test_list_and_delete(storage):
    storage.write("a/x", [b"1"])
    storage.write("a/y/z", [b"2"])
    storage.write("b", [b"3"])
    assert storage.list("") == ["a", "b"]
    assert storage.list("a") == ["x", "y"]
    storage.delete("a")
    storage.delete("missing")
    assert storage.list("") == ["b"]


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        open_storage(str(tmp_path / "f"))


def test_unknown_schemes_and_options_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no file system for this URL"):
        open_storage("nosuchscheme://bucket/x")
    with pytest.raises(ValueError, match=r"unknown S3 storage options \['endpont'\]"):
        open_storage("s3://bucket/x", {"endpont": "http://x"})
    with pytest.raises(ValueError, match="at least 5 MiB"):
        open_storage("s3://bucket/x", {"part_size": 1024})
    with pytest.raises(CheckpointError, match="takes no storage options"):
        open_storage(str(tmp_path), {"region": "x"})


# -- the one read planner (unbroken.format.coalesce), which every block read goes through ------

_extents = st.lists(
    st.tuples(st.sampled_from("ab"), st.integers(0, 5000), st.integers(0, 3000)), max_size=25
)
_rules = st.builds(
    Rules,
    gap=st.integers(0, 600),
    small=st.one_of(st.none(), st.integers(1, 2000)),
    most=st.integers(1, 4000),
    split=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(raw=_extents, rules=_rules)
def test_read_plan_covers_every_byte_once_within_its_rules(raw, rules):
    """Every byte of every extent is in exactly one request, at its place; requests read
    no byte outside their parts but gaps within the limit, merge only small extents
    (when ``small`` is set) and span at most ``most`` bytes unless one extent alone does
    (``split=False``); split requests cross a multiple of ``most`` only within
    ``most / SLIVER`` of their ends."""
    extents = [Extent(f"k{i}", f, s, s + n) for i, (f, s, n) in enumerate(raw)]
    seen = [[0] * (e.end - e.start) for e in extents]
    for r in plan(extents, rules):
        spans = sorted((extents[i].start + lo, extents[i].start + hi) for i, lo, hi in r.parts)
        assert spans and spans[0][0] == r.start and max(e for _, e in spans) == r.end
        for i, lo, hi in r.parts:
            e = extents[i]
            assert e.file == r.file and 0 <= lo < hi <= e.end - e.start
            for b in range(lo, hi):
                seen[i][b] += 1
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert 0 <= start - end <= rules.gap
        members = {i for i, _, _ in r.parts}
        if len(members) > 1 and rules.small is not None:
            assert all(extents[i].end - extents[i].start < rules.small for i in members)
        if len(members) > 1 and not rules.split:
            assert r.end - r.start <= rules.most
        if rules.split:
            sliver = rules.most // SLIVER
            for line in range(r.start // rules.most * rules.most + rules.most, r.end, rules.most):
                assert line - r.start < sliver or r.end - line < sliver, (r.start, r.end)
    assert all(count == 1 for counts in seen for count in counts)


@pytest.mark.parametrize("split", [True, False])
def test_fetch_hands_on_each_extent_once_with_its_bytes(storage, split):
    """Reads through the planner land every byte where it belongs, into a destination or
    handed on in a buffer, across requests that cut extents apart."""
    data = bytes(range(256)) * 64
    storage.write("d/f", [data])
    extents = [Extent("a", "f", 10, 3000), Extent("b", "f", 3000, 3001),
               Extent("c", "f", 3100, 9000), Extent("d", "f", 9000, 9000),
               Extent("e", "f", 9000, 16384)]  # fmt: skip
    into = [
        memoryview(bytearray(e.end - e.start)) if i % 2 else None for i, e in enumerate(extents)
    ]
    got: dict[int, bytes] = {}

    def done(i, view):
        assert i not in got, f"extent {i} handed on twice"
        got[i] = bytes(view)

    rules = Rules(gap=200, small=None if split else 4000, most=1000, split=split)
    fetch(storage, "d", extents, into, done, threads=4, rules=rules)
    assert got == {i: data[e.start : e.end] for i, e in enumerate(extents)}
    assert into[1] is not None and bytes(into[1]) == data[3000:3001]


def test_fetch_raises_what_a_read_raised_after_every_read_finished(storage):
    storage.write("d/f", [b"x" * 100])
    extents = [Extent(f"k{i}", "f", i * 10, i * 10 + 10) for i in range(10)]
    calls: list[int] = []

    def done(i, view):
        calls.append(i)
        if i == 3:
            raise ValueError("tensor k3 fails its checksum")

    rules = Rules(gap=0, small=None, most=10, split=True)
    with pytest.raises(ValueError, match="k3"):
        fetch(storage, "d", extents, [None] * 10, done, threads=4, rules=rules)
    assert 3 in calls and len(set(calls)) == len(calls)
