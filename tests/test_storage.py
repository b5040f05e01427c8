"""The contract every storage backend passes: local, S3 (a real moto server), fsspec."""

import pytest

from unbroken.errors import CheckpointError
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
