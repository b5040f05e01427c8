"""Aborting a generation of in-process recovery: collectives stuck on a live peer fail at
once instead of at the group's timeout, on both ends, and the Checkpointer's own waits
give up (2 real gloo ranks)."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from datetime import timedelta

import pytest

from ranks import run_ranks
from unbroken.errors import CheckpointError, PeerLostError
from unbroken.job import abort

GROUP_TIMEOUT_S = 60  # what the stuck operations would otherwise wait


def _stuck_then_aborted(rank: int, world: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    abort.begin()
    with abort.tracking():
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    started = time.monotonic()
    if rank == 1:
        # Waits for a message rank 0 never sends: only rank 0's abort can end this.
        try:
            dist.recv(torch.empty(4), src=0, group=group)
        except RuntimeError as e:
            return {"raised_after_s": time.monotonic() - started, "error": str(e)}
        return {"raised_after_s": None}
    # Rank 0: the main thread in a collective that rank 1 never joins, a second thread
    # in another; a third aborts after half a second.
    side: dict[str, object] = {}

    def other() -> None:
        try:
            dist.all_gather([torch.empty(1), torch.empty(1)], torch.ones(1), group=group)
        except RuntimeError as e:
            side["raised_after_s"] = time.monotonic() - started
            side["error"] = str(e)

    thread = threading.Thread(target=other)
    thread.start()
    shut: list[int] = []
    timer = threading.Timer(0.5, lambda: shut.append(abort.shutdown()))
    timer.start()
    result: dict[str, object] = {"raised_after_s": None}
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as e:
        result = {"raised_after_s": time.monotonic() - started, "error": str(e)}
    thread.join(GROUP_TIMEOUT_S)
    timer.join()
    with pytest.raises(CheckpointError, match="a peer failed"):
        abort.check("snapshot of step 7")
    return result | {"side": side, "connections": shut[0]}


@pytest.mark.timeout(60)
def test_abort_frees_collectives_stuck_on_a_live_peer_at_both_ends():
    rank0, rank1 = run_ranks(_stuck_then_aborted)
    assert rank0["connections"] >= 1  # the tracked group's connection to rank 1
    for stuck in (rank0, rank0["side"], rank1):
        assert stuck["raised_after_s"] is not None, stuck
        assert 0.4 < stuck["raised_after_s"] < 10, stuck  # at the abort, not the timeout
        assert "closed" in str(stuck["error"]).lower(), stuck


def _stuck_on_a_stopped_peer(rank: int, world: int) -> dict[str, object]:
    import os
    import signal

    import torch
    import torch.distributed as dist

    from unbroken.job.comm import gloo_group

    abort.begin()
    group = gloo_group(lambda: dist.new_group(backend="gloo", timeout=timedelta(seconds=60)))
    # The lazy group's pair connects only now, after its creation (no inode recorded),
    # from one rank to the other's listener: the rank that connected is the one tested.
    dist.all_reduce(torch.ones(1), group=group)
    made = [(a, b) for a, b in _connections() if b in abort._listeners]
    accepted = [a for a, _ in _connections() if a in abort._listeners]
    mine = torch.tensor([os.getpid(), int(bool(made) and not accepted)])
    rows = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    [(pid, connected)] = [(int(r[0]), int(r[1])) for r in rows if r is not rows[rank]] or [(0, 0)]
    if not int(mine[1]):  # the peer connected to this rank: a machine gone silent here
        os.kill(os.getpid(), signal.SIGSTOP)
        return {}
    threading.Timer(0.5, abort.shutdown).start()
    started = time.monotonic()
    result: dict[str, object] = {"raised_after_s": None, "made": made, "peer_made": connected}
    try:
        dist.recv(torch.empty(4), src=1 - rank, group=group)  # the peer is stopped: never sent
    except RuntimeError as e:
        result |= {"raised_after_s": time.monotonic() - started, "error": str(e)}
    os.kill(pid, signal.SIGCONT)
    return result


def _connections() -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """(local, remote) of this process's connected TCP sockets."""
    found = []
    for fd in abort._sockets():
        with contextlib.suppress(OSError), abort._dup(fd) as sock:
            if abort._tcp(sock):
                found.append(
                    (abort._address(sock.getsockname()), abort._address(sock.getpeername()))
                )
    return found


JOINED_TIMEOUT_S = 10  # the group's timeout in the join test: the old wait's bound
LEFT_S = 6.0  # how long the rank that left for the next generation stays alive


def _left_behind_in_a_join(rank: int, world: int) -> dict[str, object]:
    """Rank 0 is aborted as its group is created and leaves (for the next generation,
    alive); rank 1's abort comes 0.5 s into sharing the group's listeners, which waits
    on rank 0 over a connection no abort knows yet."""
    import torch.distributed as dist

    from unbroken.job.comm import gloo_group

    abort.begin()
    make = lambda: dist.new_group(backend="gloo", timeout=timedelta(seconds=JOINED_TIMEOUT_S))  # noqa: E731
    if rank == 0:
        aborted = lambda: (make(), abort.shutdown())[0]  # noqa: E731
        try:
            gloo_group(aborted)
        except PeerLostError as e:
            time.sleep(LEFT_S)  # in the next generation: its listener still accepts
            return {"raised": str(e)}
        return {"raised": None}
    threading.Timer(0.5, abort.shutdown).start()
    started = time.monotonic()
    try:
        gloo_group(make)
    except Exception as e:
        return {"after_s": time.monotonic() - started, "error": f"{type(e).__name__}: {e}"}
    return {"after_s": None}


@pytest.mark.timeout(90)
def test_a_rank_aborted_as_it_joins_a_group_never_waits_for_peers_that_left():
    """A node lost as a generation forms: a rank still building its group when the abort
    came stops at once; one already sharing the group's listeners with a peer that left
    stops at its abort, not when the peer goes away or at the group's timeout (it once
    waited the whole timeout, and the generation after it with it)."""
    left, joining = run_ranks(_left_behind_in_a_join, timeout=60)
    assert "stopped because a peer failed" in str(left["raised"]), left
    assert str(joining["error"]).startswith("PeerLostError"), joining
    assert joining["after_s"] is not None and 0.4 < float(joining["after_s"]) < 3, joining


@pytest.mark.timeout(90)
def test_abort_frees_a_collective_stuck_on_a_stopped_peer_over_a_lazy_connection():
    """The connection was made after the group was built, from this rank to the stopped
    peer's listener: only the peer's address says it is the group's."""
    [stuck] = [r for r in run_ranks(_stuck_on_a_stopped_peer) if r]
    assert stuck["made"] and not stuck["peer_made"]  # one connection, made by this end
    assert stuck["raised_after_s"] is not None, stuck
    assert 0.4 < stuck["raised_after_s"] < 10, stuck  # at the abort, not the 60 s timeout
    assert "closed" in str(stuck["error"]).lower() or "reset" in str(stuck["error"]).lower()


UNSEEN_TIMEOUT_S = 30  # the group's timeout in the untracked-receive test


def _waiting_on_an_unseen_connection(rank: int, world: int) -> dict[str, object]:
    """Rank 1 waits on rank 0, which never takes part, on a group the abort does not
    know (as a connection still being made when the generation was aborted): first a
    receive, then a broadcast. Only the bounded waits can end them before the group's
    timeout."""
    import torch
    import torch.distributed as dist

    from unbroken.job.transfers import Transfers, done

    abort.begin()
    groups = [dist.new_group(backend="gloo", timeout=timedelta(seconds=UNSEEN_TIMEOUT_S))]
    groups.append(dist.new_group(backend="gloo", timeout=timedelta(seconds=UNSEEN_TIMEOUT_S)))
    for group in groups:
        dist.barrier(group=group)  # the pairs are connected, and not tracked
    if rank == 0:
        time.sleep(7)  # alive, connected, never taking part
        return {}
    into = torch.empty(4)
    waits = {
        "receive": lambda: Transfers(
            [dist.P2POp(dist.irecv, into, group=groups[0], group_peer=0)]
        ).wait("sending the record of step 9"),
        "broadcast": lambda: done(
            dist.broadcast(into, group=groups[1], group_src=0, async_op=True), "saving step 9"
        ),
    }
    result: dict[str, object] = {}
    for name, wait in waits.items():
        abort.begin()
        threading.Timer(0.5, abort.shutdown).start()
        started = time.monotonic()
        try:
            wait()
        except Exception as e:
            result[name] = (time.monotonic() - started, f"{type(e).__name__}: {e}")
    return result


@pytest.mark.timeout(90)
def test_waits_on_a_connection_the_abort_cannot_see_stop_at_the_abort():
    """A record exchange whose receive the abort could not wake (its connection was
    being made as the generation was aborted) once waited out the group's timeout, a
    minute, while the rest of the job timed out waiting for this rank to join the next
    generation. Receives and the checkpointer's collectives stop at the abort, naming
    what they were doing."""
    _, waited = run_ranks(_waiting_on_an_unseen_connection, timeout=60)
    after_s, error = waited["receive"]
    assert error.startswith("PeerLostError: sending the record of step 9"), error
    assert 0.4 < after_s < 3, waited
    after_s, error = waited["broadcast"]
    assert error.startswith("PeerLostError: saving step 9"), error
    assert 0.4 < after_s < 3, waited


def test_checkpointer_waits_give_up_once_aborted():
    from unbroken.job.background import wait_for as _wait

    never: Future[None] = Future()
    abort.begin()
    try:
        threading.Timer(0.2, abort.shutdown).start()
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="waiting for replication: stopped"):
            _wait([never], "waiting for replication")
        assert time.monotonic() - started < 5
    finally:
        abort.begin()
        abort._enabled = False  # this process is not under in-process recovery


def test_waits_share_one_helper_thread_and_one_left_stuck_never_holds_up_the_next():
    """`abort.waited` runs its work on a helper thread kept for the next wait (one a step
    is started per step otherwise); a helper left in a wait that the abort gave up on is
    not given the next one."""
    abort.begin()
    stuck = threading.Event()
    try:
        helpers = [abort.waited("a wait", threading.current_thread) for _ in range(50)]
        assert len(set(helpers)) == 1 and helpers[0] is not threading.current_thread()
        threading.Timer(0.2, abort.shutdown).start()
        with pytest.raises(PeerLostError, match="a stuck wait: stopped"):
            abort.waited("a stuck wait", stuck.wait)
        abort.begin()  # the next generation: its waits must not queue behind the stuck one
        started = time.monotonic()
        assert abort.waited("the next wait", threading.current_thread) is not helpers[0]
        assert time.monotonic() - started < 1
    finally:
        stuck.set()
        abort.begin()
        abort._enabled = False  # this process is not under in-process recovery


def _gloo_only(rank: int, world: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    aborted = abort.abort_nccl()  # gloo groups are not NCCL's: left alone
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"aborted": aborted, "sum": t.item()}


@pytest.mark.timeout(60)
def test_nccl_abort_leaves_gloo_groups_alone():
    results = run_ranks(_gloo_only)
    assert [r["aborted"] for r in results] == [0, 0]
    assert [r["sum"] for r in results] == [2.0, 2.0]


@pytest.mark.timeout(60)
def test_nccl_group_is_aborted_with_torchs_abort():
    """GPU only: a one-rank NCCL group aborted through torch's own abort fails its next
    collective instead of running it."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        pytest.skip("needs a CUDA GPU and NCCL")
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert abort.abort_nccl() == 1
        with pytest.raises(Exception):  # noqa: B017 (torch raises a DistBackendError or RuntimeError)
            dist.all_reduce(t)
            torch.cuda.synchronize()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


_JOIN_ABORTED = """
import json, os, threading, time
import torch.distributed as dist
from torch.distributed import distributed_c10d
from unbroken.job import abort
from unbroken.run import inprocess

server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
abort.begin(1)
threading.Timer(0.5, abort.shutdown, args=(1,)).start()
started = time.monotonic()
try:  # rank 0 of 2: its peer never comes, only the abort can end the wait
    inprocess._join(1, rank=0, world=2, timeout_s=60)
    error = None
except Exception as e:
    error = str(e)
waited = time.monotonic() - started
inprocess._abandon(1)
count = distributed_c10d._world.group_count
abort.begin(2)
inprocess._join(2, rank=0, world=1, timeout_s=60)
print(json.dumps({"error": error, "waited": waited, "count": count,
                  "name": distributed_c10d._get_default_group().group_name}))
"""


@pytest.mark.timeout(60)
def test_abort_ends_a_generations_rendezvous_and_the_next_one_names_groups_alike():
    """A generation aborted while its ranks still wait for each other to join (a second
    rank died meanwhile): the wait ends at once, not at the 60 s timeout, and the next
    generation's group is named "0", as on a replacement that starts fresh (a stale name
    made survivors and replacements wait on different rendezvous keys forever)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "UNBROKEN_IN_PROCESS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _JOIN_ABORTED], capture_output=True, text=True, timeout=50, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["error"] is not None
    assert found["waited"] < 10, found
    assert found["count"] == 0 and found["name"] == "0", found


def _group_used_after_losing_a_peer(rank: int, world: int) -> dict[str, object]:
    import os

    from unbroken.job.comm import Comm

    comm = Comm(None, timedelta(seconds=GROUP_TIMEOUT_S))
    assert comm.all_gather(rank) == [0, 1]
    if rank == 1:
        os._exit(0)  # gone, its sockets closed by the kernel
    with pytest.raises(PeerLostError, match="lost a peer: another rank is gone"):
        comm.all_gather("lost")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="lost a peer earlier"):
        comm.together("the next step", lambda: None)
    return {"lost": comm.lost, "refused_after_s": time.monotonic() - started}


@pytest.mark.timeout(90)
def test_a_group_that_lost_a_peer_is_not_used_again():
    """After a collective fails on a vanished peer, the Checkpointer's group refuses
    further collectives at once: a rank issuing its next collective while a live peer is
    still in an earlier one can pair two different operations, which gloo answers by
    ending the process."""
    found = run_ranks(_group_used_after_losing_a_peer, exits=[1])[0]
    assert found["lost"] and found["refused_after_s"] < 1, found
