"""Background saves: what is saved, bounded memory, failures, shutdown, concurrency."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import unbroken
import unbroken.saving.checksums as sums
from conftest import make_model, train_steps
from ranks import run_ranks
from unbroken import Checkpointer, CheckpointError


class GatedStorage:
    """Delegates to a real storage, but data writes wait until ``gate`` is set (and fail
    if ``fail`` is set), so a test decides when the background work may go on."""

    def __init__(self, inner, fail=False):
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = fail

    def write(self, path, parts):
        self.entered.set()
        assert self.gate.wait(timeout=60), "test never opened the gate"
        if self.fail:
            raise OSError(28, "No space left on device", path)
        return self.inner.write(path, parts)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _gated(ckpt, fail=False):
    ckpt.storage = GatedStorage(ckpt.storage, fail=fail)
    return ckpt.storage


def test_updates_right_after_save_returns_do_not_leak_into_the_checkpoint(tmp_path):
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_steps(model, optim, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(tmp_path)
    gate = _gated(ckpt)
    handle = ckpt.save(2, {"model": model, "optim": optim}, blocking=False)
    assert not handle.done()
    train_steps(model, optim, 3)  # the training loop goes on at once
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    gate.gate.set()
    assert handle.wait() is True
    fresh = make_model(seed=3)
    Checkpointer(tmp_path).restore({"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())})
    got = fresh.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_the_staging_buffer_is_allocated_once_and_reused(tmp_path):
    ckpt = Checkpointer(tmp_path)
    state = {"w": torch.randn(1000), "b": torch.randn(10)}
    ckpt.save(1, state, blocking=False).wait()
    arena = ckpt._stager._free[0]
    assert arena.buffer is not None
    pointer = arena.buffer.data_ptr()
    for step in range(2, 6):
        state["w"].add_(1)
        ckpt.save(step, state, blocking=False).wait()
    assert arena.buffer.data_ptr() == pointer
    assert ckpt._stager._free == [arena]


def test_prepare_stages_ahead_and_the_first_save_reuses_it(tmp_path):
    ckpt = Checkpointer(tmp_path)
    state = {"w": torch.randn(1 << 16), "b": torch.randn(10)}
    assert ckpt._stager.nbytes == 0  # nothing held unasked
    ckpt.prepare(state)
    arena = ckpt._stager._free[0]
    for _ in range(200):  # the reservation runs in the background
        if not arena.reserving:
            break
        threading.Event().wait(0.05)
    assert arena.buffer is not None and arena.nbytes >= (1 << 18) + 40
    assert int(arena.buffer[::4096].count_nonzero()) == 0  # touched: zeroed page by page
    pointer, views = arena.buffer.data_ptr(), arena._views
    assert views is not None  # the copies' views into it are made too
    expected = {k: v.clone() for k, v in state.items()}
    ckpt.save(1, state, blocking=False)
    state["w"].add_(1)  # the copy was taken: this change is not in step 1
    ckpt.wait()
    assert arena.buffer.data_ptr() == pointer  # the first save allocated nothing
    assert arena._views is views  # nor made views of its own
    got = {"w": torch.zeros(1 << 16), "b": torch.zeros(10)}
    assert Checkpointer(tmp_path).restore(got) == 1
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_background_failure_surfaces_and_the_last_checkpoint_stays_loadable(tmp_path, caplog):
    model = make_model()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"model": model})
    good = {k: v.clone() for k, v in model.state_dict().items()}
    storage = _gated(ckpt, fail=True)
    with torch.no_grad():
        next(model.parameters()).add_(1)
    handle = ckpt.save(2, {"model": model}, blocking=False)
    storage.gate.set()
    with pytest.raises(OSError, match="No space left"):
        handle.wait()
    assert "saving step 2 failed: [Errno 28] No space left" in caplog.text  # logged at once
    ckpt.save(3, {"model": model}, blocking=False)  # step 2 was raised by wait(): not again
    with pytest.raises(CheckpointError, match="background save of step 3 failed") as info:
        ckpt.wait()
    assert isinstance(info.value.__cause__, OSError)
    ckpt.save(4, {"model": model}, blocking=False)._future.exception(timeout=30)  # let it fail
    with pytest.raises(CheckpointError, match="background save of step 4 failed"):
        ckpt.save(5, {"model": model}, blocking=False)  # the next save raises it
    ckpt.storage = storage.inner
    assert ckpt.steps() == [1]
    fresh = make_model(seed=9)
    assert Checkpointer(tmp_path).restore({"model": fresh}) == 1
    assert all(torch.equal(fresh.state_dict()[k], good[k]) for k in good)


def test_on_error_warn_keeps_training_going(tmp_path):
    ckpt = Checkpointer(tmp_path, on_error="warn")
    storage = _gated(ckpt, fail=True)
    storage.gate.set()
    ckpt.save(1, {"w": torch.ones(3)}, blocking=False)
    ckpt_wait = pytest.warns(UserWarning, match="background save of step 1 failed")
    with ckpt_wait:
        ckpt.wait()
    storage.fail = False
    ckpt.save(2, {"w": torch.ones(3)}, blocking=False).wait()
    assert ckpt.steps() == [2]


def test_if_busy_skip_skips_instead_of_allocating_another_copy(tmp_path):
    ckpt = Checkpointer(tmp_path, if_busy="skip")
    storage = _gated(ckpt)
    state = {"w": torch.ones(100)}
    first = ckpt.save(1, state, blocking=False)
    second = ckpt.save(2, state, blocking=False)
    storage.gate.set()
    assert first.wait() is True and second.wait() is False
    assert ckpt.steps() == [1]


def test_if_busy_wait_blocks_until_the_buffer_is_free(tmp_path):
    ckpt = Checkpointer(tmp_path)
    storage = _gated(ckpt)
    state = {"w": torch.ones(100)}
    ckpt.save(1, state, blocking=False)
    storage.entered.wait(timeout=30)
    started = threading.Event()
    second: list = []

    def save_again():
        started.set()
        second.append(ckpt.save(2, state, blocking=False))

    thread = threading.Thread(target=save_again)
    thread.start()
    started.wait(timeout=30)
    thread.join(timeout=0.2)
    assert thread.is_alive() and not second  # waiting for the staging buffer
    storage.gate.set()
    thread.join(timeout=30)
    assert second[0].wait() is True and ckpt.steps() == [1, 2]


def test_close_and_with_wait_for_pending_saves(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        storage = _gated(ckpt)
        handle = ckpt.save(5, {"w": torch.ones(3)}, blocking=False)
        threading.Timer(0.1, storage.gate.set).start()
    assert handle.done() and ckpt.steps() == [5]
    with pytest.raises(CheckpointError, match="is closed"):
        ckpt.save(6, {"w": torch.ones(3)})


def test_exiting_with_a_pending_save_warns_then_finishes_it(tmp_path):
    script = textwrap.dedent(
        f"""
        import logging, threading, torch, unbroken
        logging.basicConfig()
        ckpt = unbroken.Checkpointer({str(tmp_path)!r})
        inner, gate = ckpt.storage, threading.Event()
        class Slow:
            def write(self, path, parts):
                gate.wait(timeout=5)
                return inner.write(path, parts)
            def __getattr__(self, name):
                return getattr(inner, name)
        ckpt.storage = Slow()
        ckpt.save(7, {{"w": torch.ones(3)}}, blocking=False)
        threading.Timer(0.5, gate.set).start()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "exiting with saves of steps [7] still persisting" in result.stderr
    assert Checkpointer(tmp_path).steps() == [7]


def test_exiting_after_an_overlapped_save_without_another_step_finishes_it(tmp_path):
    """The save's copy waits for the next optimizer step (`unbroken.job.overlap`); a script
    that ends right after ``save`` has none: exiting settles the copy, and commits."""
    script = textwrap.dedent(
        f"""
        import logging, torch, unbroken
        logging.basicConfig()
        model = torch.nn.Linear(64, 64)
        optim = torch.optim.AdamW(model.parameters())
        ckpt = unbroken.Checkpointer({str(tmp_path)!r})
        model(torch.ones(2, 64)).sum().backward()
        optim.step()
        ckpt.save(3, {{"model": model, "optim": optim}}, blocking=False)
        torch.save(model.state_dict(), {str(tmp_path / "live.pt")!r})
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    assert Checkpointer(tmp_path).restore({"model": model, "optim": optim}) == 3
    live = torch.load(tmp_path / "live.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in live.items())


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_rss_does_not_grow_over_50_async_saves(tmp_path):
    state = {f"t{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in range(5):  # the staging buffer and the first files exist after these
        ckpt.save(step, state, blocking=False)
    ckpt.wait()
    before = _rss()
    for step in range(5, 55):
        state["t0"].add_(1)
        ckpt.save(step, state, blocking=False)
    ckpt.wait()
    grown = _rss() - before
    assert grown < 8 << 20, f"RSS grew by {grown / 2**20:.1f} MiB over 50 saves of 32 MiB"
    assert ckpt.steps() == [53, 54]


def _concurrent_job(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    ckpt = unbroken.Checkpointer(path)
    storage = _gated(ckpt)
    state = {"w": torch.full((4,), float(rank))}
    handle = ckpt.save(1, state, blocking=False)
    # The commit cannot finish until the gate opens, and the gate opens only after the
    # training loop's own collectives: they must run while the background save is pending.
    total = torch.zeros(1)
    for _ in range(20):
        dist.barrier()
        x = torch.ones(1)
        dist.all_reduce(x)
        total += x
    pending_during = not handle.done()
    storage.gate.set()
    committed = handle.wait(timeout=60)
    ckpt.close()
    return {"total": total.item(), "pending": pending_during, "committed": committed}


@pytest.mark.timeout(120)
def test_user_collectives_run_while_a_background_commit_is_pending(tmp_path):
    results = run_ranks(_concurrent_job, str(tmp_path))
    assert all(r == {"total": 40.0, "pending": True, "committed": True} for r in results)
    assert Checkpointer(tmp_path).steps() == [1]


def _skip_job(rank: int, world: int, path: str) -> list:
    # Rank 0 has a spare buffer, so only rank 1 finds none free at step 2.
    ckpt = unbroken.Checkpointer(path, if_busy="skip", staging_buffers=2 - rank)
    storage = _gated(ckpt)
    if rank == 0:
        storage.gate.set()
    state = {"w": torch.ones(4)}
    first = ckpt.save(1, state, blocking=False)
    storage.entered.wait(timeout=30)  # rank 1's step 1 is stuck writing
    second = ckpt.save(2, state, blocking=False)
    storage.gate.set()
    outcome = [first.wait(timeout=60), second.wait(timeout=60)]
    ckpt.close()
    return outcome


@pytest.mark.timeout(120)
def test_a_step_skipped_on_one_rank_is_skipped_on_every_rank(tmp_path):
    results = run_ranks(_skip_job, str(tmp_path))
    assert results[1] == [True, False]
    assert results[0] == [True, False]  # rank 0 had a free buffer, yet skips with rank 1
    assert Checkpointer(tmp_path).steps() == [1]


def test_a_background_save_hashes_and_writes_on_one_thread_a_blocking_one_on_io_threads(
    tmp_path, monkeypatch
):
    """A background save takes one core from training at most (bench/overlap.py: with
    io_threads of them, the training thread waited for a core); a blocking save, which
    the loop waits for, still spreads over ``io_threads``."""
    threads: set[int] = set()
    hash_block = sums.block_checksums

    def hashing(view):
        threads.add(threading.get_ident())
        time.sleep(0.01)  # long enough for a second worker to take the next block
        return hash_block(view)

    monkeypatch.setattr(sums, "block_checksums", hashing)
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_steps(model, optim, 1)
    state = {"model": model, "optim": optim}
    with Checkpointer(tmp_path, io_threads=2) as ckpt:
        writes = ckpt.storage.write

        def writing(path, parts):
            threads.add(threading.get_ident())
            time.sleep(0.05)
            return writes(path, parts)

        monkeypatch.setattr(ckpt.storage, "write", writing)
        ckpt.save(1, state, blocking=False).wait()
        assert len(threads) == 1, "a background save hashed or wrote on several threads"
        threads.clear()
        ckpt.save(2, state)
        assert len(threads) >= 2, "a blocking save ran on one thread"
