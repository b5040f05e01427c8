"""Resource exhaustion: a full disk, full shared memory, permission denied, an S3
throttling storm and a stalled S3 connection. Each save that cannot complete fails with
a message naming what and where; the last good checkpoint stays intact; training goes on
(``on_error="warn"``) or stops with that message (``on_error="raise"``, the default); and
when one rank's storage fails, every rank fails within a bounded time (marin #9213)."""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ranks import run_ranks
from servers.faulty_proxy import FaultyProxy
from unbroken import Checkpointer
from unbroken.errors import CheckpointError

root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting a small tmpfs and switching users need root"
)


@contextlib.contextmanager
def small_tmpfs(path: str, size: str) -> Iterator[str]:
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def in_child(fn: Callable[..., Any], *args: Any, user: str | None = None) -> Any:
    """``fn()`` in a spawned process (as ``user``), its result returned: a regression that
    kills the process (SIGBUS) fails the test, not the suite. Spawned, not forked: a
    fork of a process whose torch thread pools have run may deadlock."""
    return run_ranks(_as, fn, args, user, world=1, timeout=60)[0]


def _as(rank: int, world: int, fn: Callable[..., Any], args: tuple, user: str | None) -> Any:
    if user is not None:  # after the imports: the interpreter may live under /root
        who = pwd.getpwnam(user)
        os.setgid(who.pw_gid)
        os.setuid(who.pw_uid)
    return fn(*args)


def state(step: int, n: int = 1000) -> dict[str, Any]:
    return {"w": torch.arange(n, dtype=torch.float32) + step, "meta": {"step": step}}


def restored(path: str, n: int = 1000, **kwargs: Any) -> tuple[int | None, bool]:
    fresh: dict[str, Any] = {"w": torch.zeros(n), "meta": {}}
    step = Checkpointer(path, **kwargs).restore(fresh)
    same = step is not None and torch.equal(fresh["w"], state(step, n)["w"])
    return step, same and fresh["meta"] == {"step": step}


def _finished(handle: Any) -> None:
    """Until a background save has failed (without asking it, which would count as
    being told: the next save is to tell)."""
    while not handle.done():
        time.sleep(0.01)


BIG = 1 << 20  # 4 MiB of float32: more than the small file systems hold


@root_only
@pytest.mark.timeout(60)
def test_a_full_disk_fails_the_save_clearly_keeps_the_last_checkpoint_and_retries(tmp_path):
    with small_tmpfs(str(tmp_path / "disk"), "3m") as disk:
        path = os.path.join(disk, "ckpt")
        ckpt = Checkpointer(path)  # on_error="raise": stop with the message
        ckpt.save(1, state(1))
        _finished(ckpt.save(2, state(2, BIG), blocking=False))
        with pytest.raises(CheckpointError) as failure:
            ckpt.save(3, state(3))
        message = str(failure.value)
        assert "background save of step 2 failed" in message and path in message
        assert "No space left on device" in message and "keep fewer checkpoints" in message
        assert os.listdir(path) == sorted(os.listdir(path)) and "step-000000002" not in str(
            os.listdir(path)
        )  # the failed step's files are gone
        assert restored(path) == (1, True)
        # on_error="warn": training goes on, and the next save tries again (and succeeds).
        ckpt = Checkpointer(path, on_error="warn")
        _finished(ckpt.save(4, state(4, BIG), blocking=False))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.save(5, state(5))
        assert any("step 4 failed" in str(w.message) for w in caught)
        ckpt.close()
        assert ckpt.steps() == [1, 5] and restored(path) == (5, True)


def _fill_memory(path: str, shm: str) -> tuple[str, int | None, bool]:
    ckpt = Checkpointer(path, memory=True, memory_dir=shm, job="full")
    ckpt.snapshot(1, state(1))
    ckpt.wait()
    try:
        ckpt.snapshot(2, state(2, BIG))
        error = "no error"
    except CheckpointError as e:
        error = str(e)
    ckpt.close()
    return (error, *restored(path, memory=True, memory_dir=shm, job="full"))


@root_only
@pytest.mark.timeout(60)
def test_full_shared_memory_fails_the_snapshot_clearly_and_keeps_the_last(tmp_path):
    with small_tmpfs(str(tmp_path / "shm"), "2m") as shm:
        error, step, same = in_child(_fill_memory, str(tmp_path / "ckpt"), shm)
    assert "no room for the snapshot of step 2" in error and "--shm-size" in error
    assert (step, same) == (1, True)  # the snapshot before is whole, and restored


def _save_step_2(path: str) -> str:
    try:
        Checkpointer(path).save(2, state(2))
        return "saved"
    except CheckpointError as e:
        return str(e)


@root_only
@pytest.mark.timeout(60)
def test_permission_denied_names_the_path_and_leaves_the_checkpoint_alone(tmp_path):
    base = tempfile.mkdtemp(prefix="unbroken-perm-")  # every user may look in: 0755
    os.chmod(base, 0o755)
    path = os.path.join(base, "ckpt")
    Checkpointer(path).save(1, state(1))
    os.chmod(path, 0o755)  # this user's, closed to writing by others

    error = in_child(_save_step_2, path, user="nobody")
    assert path in error and "Permission denied" in error and "check the owner" in error
    assert restored(path) == (1, True)
    shutil.rmtree(base)


# -- S3 ---------------------------------------------------------------------------------


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[tuple[FaultyProxy, str]]:
    proxy = FaultyProxy(moto_endpoint)
    endpoint = proxy.start()
    yield proxy, endpoint
    proxy.stop()


def _via(options: dict, endpoint: str, **more: Any) -> dict:
    return {**options, "endpoint": endpoint, **more}


@pytest.mark.timeout(90)
def test_an_s3_throttling_storm_slows_saves_but_they_complete(bucket, proxy):
    uri, options = bucket
    faulty, endpoint = proxy
    counter = itertools.count()
    # 503 SlowDown on three requests in four, whatever they are.
    storm = faulty.inject("503", lambda m, p: next(counter) % 4 != 3, times=10**6)
    ckpt = Checkpointer(uri, storage_options=_via(options, endpoint, max_retries=20))
    for step in (1, 2, 3):
        ckpt.save(step, state(step, 200_000), blocking=step != 2)
    ckpt.close()
    assert storm.hits > 30, storm.hits
    faulty.clear()
    assert restored(uri, 200_000, storage_options=options) == (3, True)


@pytest.mark.timeout(90)
def test_an_endless_storm_fails_the_save_in_bounded_time_and_keeps_the_last(bucket, proxy):
    uri, options = bucket
    faulty, endpoint = proxy
    ckpt = Checkpointer(uri, storage_options=_via(options, endpoint, retry_timeout=3.0))
    ckpt.save(1, state(1))
    faulty.inject("503", lambda m, p: "step-000000002" in p, times=10**6)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"SlowDown|503|slow down"):
        ckpt.save(2, state(2))
    assert time.monotonic() - started < 30
    faulty.clear()
    ckpt.save(3, state(3))  # the storm is over: saving goes on
    assert ckpt.steps() == [1, 3] and restored(uri, storage_options=options) == (3, True)


@pytest.mark.timeout(90)
def test_a_stalled_s3_connection_is_cut_and_retried(bucket, proxy):
    uri, options = bucket
    faulty, endpoint = proxy
    stall = faulty.inject("delay", lambda m, p: m == "PUT" and ".safetensors" in p, 1, 60.0)
    ckpt = Checkpointer(uri, storage_options=_via(options, endpoint, timeout=2.0))
    started = time.monotonic()
    ckpt.save(1, state(1))
    assert stall.hits == 1 and time.monotonic() - started < 30
    ckpt.close()
    assert restored(uri, storage_options=options) == (1, True)


def _one_rank_throttled(rank: int, world: int, uri: str, options: dict) -> dict[str, Any]:
    ckpt = Checkpointer(uri, storage_options=options[rank], timeout=60)
    mine = {"w": torch.full((50_000,), float(rank)), "meta": {"rank": rank}}
    ckpt.save(1, mine)
    started = time.monotonic()
    try:
        ckpt.save(2, mine)  # rank 1's requests for step 2 all get 503 SlowDown
        error = None
    except CheckpointError as e:
        error = str(e)
    took = time.monotonic() - started
    ckpt.save(3, mine)  # training goes on; every rank saves again together
    steps = ckpt.steps()
    ckpt.close()
    return {"error": error, "seconds": took, "steps": steps}


@pytest.mark.timeout(120)
def test_when_one_ranks_storage_fails_every_rank_fails_in_bounded_time(bucket, proxy):
    uri, options = bucket
    faulty, endpoint = proxy
    faulty.inject("503", lambda m, p: "step-000000002" in p, times=10**6)
    per_rank = [options, _via(options, endpoint, retry_timeout=4.0)]
    results = run_ranks(_one_rank_throttled, uri, per_rank, timeout=100)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not fail"
        assert result["seconds"] < 30, results  # not the group's 60 s, nor forever
        assert result["steps"] == [1, 3], results
    assert "rank 1" in results[0]["error"], results[0]["error"]  # names who failed
