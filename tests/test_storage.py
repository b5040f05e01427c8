"""The contract every storage backend passes."""

import pytest

from unbroken.errors import CheckpointError
from unbroken.storage import Storage, open_storage


@pytest.fixture(params=["local"])
def storage(request, tmp_path) -> Storage:
    return open_storage(str(tmp_path / "root"))


def test_write_then_read_back(storage):
    storage.write("d/f", [b"head", memoryview(b"body")])
    assert storage.read("d/f") == b"headbody"
    assert storage.size("d/f") == 8
    out = bytearray(3)
    storage.read_into("d/f", 2, memoryview(out))
    assert out == b"adb"


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


def test_unknown_schemes_are_refused():
    with pytest.raises(CheckpointError, match="scheme 'gs' is not supported"):
        open_storage("gs://bucket/x")
