"""Large files written past the page cache (`unbroken.storage.direct`): the same bytes
as a buffered write, none of them left in the page cache, and a file system that refuses
direct writes gets a whole, buffered file."""

import ctypes
import errno
import fcntl
import mmap
import os
from pathlib import Path

import pytest

from unbroken.storage import direct
from unbroken.storage.local import LocalStorage

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages in all), by mincore(2)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        start = ctypes.c_char.from_buffer(m)
        address = ctypes.addressof(start)
        del start  # the map may close
        vec = (ctypes.c_ubyte * pages)()
        # mincore only looks: no page is read in (the file is read after it, never before).
        assert _libc.mincore(address, size, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def parts_of(size: int) -> list:
    """A safetensors-like file: an odd-sized header, then tensors at unaligned offsets."""
    body = os.urandom(size)
    return [b"{" * 123, memoryview(body)[: size // 3], memoryview(body)[size // 3 :], b"t" * 5]


@pytest.fixture
def storage(tmp_path):
    direct._refused.clear()
    yield LocalStorage(str(tmp_path))
    direct._refused.clear()


def test_a_large_file_is_written_whole_and_left_out_of_the_page_cache(storage, tmp_path):
    parts = parts_of(direct.MIN_BYTES + 3 * direct.BOUNCE + 12345)  # a partial last block
    storage.write("step/shard", parts)
    path = str(tmp_path / "step/shard")
    resident, pages = resident_pages(path)
    assert resident <= 1, f"{resident} of {pages} pages cached: the write was buffered"
    assert Path(path).read_bytes() == b"".join(bytes(p) for p in parts)


def test_a_small_file_is_buffered(storage, tmp_path):
    storage.write("manifest", [b"m" * 50_000])
    resident, pages = resident_pages(str(tmp_path / "manifest"))
    assert resident == pages and (tmp_path / "manifest").read_bytes() == b"m" * 50_000


@pytest.mark.parametrize("refused_at", ["flag", "second write"])
def test_a_file_system_refusing_direct_writes_gets_the_whole_file_buffered(
    storage, tmp_path, monkeypatch, refused_at
):
    """EINVAL is what Linux answers where a file system cannot write directly: at the
    flag (tmpfs before 6.6) or at a write (an alignment it needs that is not ours)."""
    set_flags, pwrite, writes = fcntl.fcntl, os.pwrite, []

    def refusing_fcntl(fd, cmd, arg=0):
        if refused_at == "flag" and cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return set_flags(fd, cmd, arg)

    def refusing_pwrite(fd, data, offset):
        writes.append(offset)
        if refused_at == "second write" and len(writes) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(direct.fcntl, "fcntl", refusing_fcntl)
    monkeypatch.setattr(direct.os, "pwrite", refusing_pwrite)
    parts = parts_of(direct.MIN_BYTES + direct.BOUNCE)
    storage.write("step/shard", parts)
    path = str(tmp_path / "step/shard")
    assert resident_pages(path)[0] > 1  # buffered
    assert Path(path).read_bytes() == b"".join(bytes(p) for p in parts)
    assert direct._refused == {os.stat(path).st_dev}  # not asked again
    before = len(writes)
    storage.write("step/other", parts)
    assert len(writes) == before
    assert (tmp_path / "step/other").read_bytes() == b"".join(bytes(p) for p in parts)
