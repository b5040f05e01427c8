"""Overlapped capture (`unbroken.job.overlap`): a background save copies parameters and
optimizer state beside the next forward and backward, and the step it commits still
holds the values at the save, whatever the loop changes at every moment it may."""

import os
import threading

import pytest
import torch
from torch import nn

from ranks import run_ranks
from unbroken import Checkpointer, CheckpointError
from unbroken.job import overlap
from unbroken.sdc import Replicated, SilentCorruptionError


def make() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # BatchNorm: buffers the forward changes, which are never deferred.
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Linear(256, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(16, 64)).pow(2).mean().backward()
    optim.step()


def state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": model, "optim": optim}


def values(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the state, cloned: the model's and the optimizer's."""
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(optim.state.values()):
        out |= {f"optim.{i}.{k}": v.clone() for k, v in s.items()}
    return out


def restored(path) -> dict[str, torch.Tensor]:
    model, optim = make()
    step(model, optim)  # the optimizer's state exists, to be loaded into
    Checkpointer(path).restore(state(model, optim))
    return values(model, optim)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("moment", ["at-once", "forward", "backward", "next-step", "wait"])
def test_every_change_the_loop_may_make_after_the_save_stays_out_of_it(tmp_path, moment):
    """After ``save(blocking=False)`` returns, the loop changes what it may, at each
    moment up to and through the next optimizer step: buffers (a forward in train
    mode), gradients, then the parameters and optimizer state (the step, which waits for
    the copy). The committed step holds exactly the values at the save."""
    model, optim = make()
    ckpt = Checkpointer(tmp_path)
    for _ in range(2):
        step(model, optim)
    expected = values(model, optim)
    handle = ckpt.save(2, state(model, optim), blocking=False)
    assert overlap._pending, "nothing was deferred: the overlap is not exercised"
    if moment in ("forward", "backward", "next-step"):
        loss = model(torch.randn(16, 64)).pow(2).mean()  # BatchNorm's buffers change
        if moment != "forward":
            optim.zero_grad()
            loss.backward()
        if moment == "next-step":
            optim.step()  # waits for the copy first
            assert not overlap._pending
            step(model, optim)
    assert handle.wait() is True
    ckpt.close()
    assert same(restored(tmp_path), expected)


def test_a_copy_torn_by_a_change_outside_the_optimizer_never_commits_pytorch_144657(tmp_path):
    """pytorch#144657 (tensors mutated during an async save, saved torn): a parameter
    changed outside ``optimizer.step()`` while its copy ran fails that save, naming the
    tensor; the step before stays committed and whole."""
    model, optim = make()
    ckpt = Checkpointer(tmp_path)
    step(model, optim)
    ckpt.save(1, state(model, optim))
    first = values(model, optim)
    step(model, optim)
    handle = ckpt.save(2, state(model, optim), blocking=False)
    with torch.no_grad():
        dict(model.named_parameters())["0.weight"].add_(1.0)  # not through the optimizer
    with pytest.raises(CheckpointError, match=r"model/0\.weight.*overlap=False"):
        handle.wait()
    assert ckpt.steps() == [1]
    ckpt.close()
    assert same(restored(tmp_path), first)


def test_overlap_off_copies_everything_before_save_returns(tmp_path):
    """``overlap=False``: the loop may change anything at once, the optimizer's
    parameters outside a step included."""
    model, optim = make()
    ckpt = Checkpointer(tmp_path, overlap=False)
    for _ in range(2):
        step(model, optim)
    expected = values(model, optim)
    handle = ckpt.save(2, state(model, optim), blocking=False)
    assert not overlap._pending
    with torch.no_grad():
        dict(model.named_parameters())["0.weight"].add_(1.0)
    assert handle.wait() is True
    ckpt.close()
    assert same(restored(tmp_path), expected)


def test_resuming_from_overlapped_saves_is_bitwise_no_nan_megatron_1713(tmp_path):
    """Megatron-LM#1713 (NaN after resuming from an async save): every step saved in the
    background with the copy overlapped, each restored into a fresh model, equals the
    live values at that step, bit for bit."""
    model, optim = make()
    ckpt = Checkpointer(tmp_path, keep=None)
    expected = {}
    for n in range(1, 7):
        step(model, optim)
        expected[n] = values(model, optim)
        ckpt.save(n, state(model, optim), blocking=False)
    ckpt.close()
    for n in range(1, 7):
        fresh, fresh_optim = make()
        step(fresh, fresh_optim)
        Checkpointer(tmp_path).restore(state(fresh, fresh_optim), step=n)
        got = values(fresh, fresh_optim)
        assert same(got, expected[n]), n
        assert not any(t.isnan().any() for t in got.values() if t.is_floating_point())


def _two_ranks(rank: int, world: int, path: str) -> None:
    """Rank 1 tears its copy of replicated state; both ranks' save of step 2 fails as
    torn, not as divergent replicas (the replicas are compared after the verdict), and
    step 1 stays."""
    model, optim = make()
    ckpt = Checkpointer(path, replicated=Replicated(("model", "optim"), action="refuse"))
    step(model, optim)
    ckpt.save(1, state(model, optim))
    step(model, optim)
    gate, copy = threading.Event(), overlap.Copy._copy
    if rank == 1:  # the copier runs late, so the copy holds the torn values
        overlap.Copy._copy = lambda self: (gate.wait(30), copy(self))  # type: ignore[method-assign,assignment]
    handle = ckpt.save(2, state(model, optim), blocking=False)
    if rank == 1:
        with torch.no_grad():
            dict(model.named_parameters())["2.bias"].mul_(2.0)
    gate.set()
    with pytest.raises(CheckpointError, match=r"2\.bias changed outside optimizer") as caught:
        handle.wait()
    assert not isinstance(caught.value, SilentCorruptionError)
    assert ckpt.steps() == [1]
    ckpt.close()


@pytest.mark.timeout(60)
def test_one_rank_torn_fails_the_save_on_every_rank(tmp_path):
    run_ranks(_two_ranks, str(tmp_path))


def test_a_copy_waits_for_the_settle_not_the_other_way_round(tmp_path):
    """The save thread waits for the training thread's settle (no optimizer step comes
    here): `PendingSave.wait` settles first, so it never waits on itself."""
    model, optim = make()
    ckpt = Checkpointer(tmp_path)
    step(model, optim)
    step(model, optim)
    handle = ckpt.save(2, state(model, optim), blocking=False)
    done = threading.Event()
    threading.Timer(30, done.set).start()
    assert handle.wait() is True and not done.is_set()
    ckpt.close()


def _memory(root) -> Checkpointer:
    return Checkpointer(root / "ckpt", memory=True, memory_dir=str(root / "shm"), job="o")


@pytest.mark.parametrize("moment", ["forward", "next-step"])
def test_a_snapshot_every_step_holds_the_values_at_its_step(tmp_path, moment):
    """`snapshot` overlaps its copy as `save` does: a snapshot after every step, the
    loop changing buffers (a forward) or stepping again at once, and each published
    snapshot restored from memory equals the values at its step, bit for bit."""
    model, optim = make()
    ckpt = _memory(tmp_path)
    step(model, optim)
    expected = {}
    for n in range(1, 6):
        step(model, optim)
        expected[n] = values(model, optim)
        ckpt.snapshot(n, state(model, optim))
        assert overlap._pending, "nothing was deferred: the overlap is not exercised"
        model(torch.randn(16, 64))
    if moment == "next-step":
        step(model, optim)
    ckpt.wait()
    fresh, fresh_optim = make()
    step(fresh, fresh_optim)
    assert _memory(tmp_path).restore(state(fresh, fresh_optim)) == 5
    assert same(values(fresh, fresh_optim), expected[5])
    ckpt.close()


def test_a_snapshot_torn_outside_the_optimizer_is_never_published(tmp_path):
    """A parameter changed outside ``optimizer.step()`` while a snapshot's copy ran:
    that snapshot is never published (the next call says why) and a restore finds the
    one before, whole."""
    model, optim = make()
    ckpt = _memory(tmp_path)
    step(model, optim)
    ckpt.snapshot(1, state(model, optim))
    ckpt.wait()
    first = values(model, optim)
    step(model, optim)
    ckpt.snapshot(2, state(model, optim))
    with torch.no_grad():
        dict(model.named_parameters())["0.weight"].add_(1.0)
    with pytest.raises(CheckpointError, match=r"snapshot of step 2.*0\.weight"):
        ckpt.wait()
    fresh, fresh_optim = make()
    step(fresh, fresh_optim)
    assert _memory(tmp_path).restore(state(fresh, fresh_optim)) == 1
    assert same(values(fresh, fresh_optim), first)
    ckpt.close()


def test_a_process_forked_during_a_save_copies_on_its_own(tmp_path):
    """The copies run on one long-lived thread, which a fork does not carry over: a
    child forked while its parent's copy is pending (a data loader's worker, say) waits
    for none of the parent's copies, and a copy of its own runs and settles."""
    model, optim = make()
    parent = Checkpointer(tmp_path)
    step(model, optim)
    parent.save(1, state(model, optim), blocking=False)
    assert overlap._pending, "nothing was deferred: the overlap is not exercised"
    pid = os.fork()
    if pid == 0:  # the child: any failure is its exit status
        code = 1
        try:
            assert not overlap._pending
            source, into = torch.arange(1000.0), torch.zeros(1000)
            copy = overlap.Copy(["t"], [source], [(into, source)], None)
            overlap.settle()
            intact = copy.verdict("the child's copy") is None and torch.equal(into, source)
            code = 0 if intact else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    step(model, optim)
    parent.wait()
    assert parent.steps() == [1]
    parent.close()
