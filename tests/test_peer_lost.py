"""A peer lost by the checkpointer's group is one `PeerLostError` of one line: gloo's own
text (its source path, its "GLHF!") stays in the cause, and in-process recovery still
takes the error as a peer's failure (issue 37)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ranks import run_ranks
from unbroken.job.comm import brief

TWO_RANK = True

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:14734: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application. Check the logs of the remote worker before "
    "reporting an error. GLHF! \N{UMBRELLA ON GROUND}"
)
CLOSED = "[../gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:5901"
FRAMES = "Connection closed by peer\nException raised from run (most recent call first):\nframe #0"
ABORTED = "snapshot of step 7: stopped because a peer failed; in-process recovery restarts it"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (GLOO, "Read error [127.0.0.1]:14734: Connection reset by peer"),
        (CLOSED, "Connection closed by peer [10.0.0.2]:5901"),
        (FRAMES, "Connection closed by peer"),
        (ABORTED, ABORTED),
    ],
)
def test_brief_keeps_the_first_line_of_what_happened(text: str, said: str) -> None:
    assert brief(RuntimeError(text)) == said


def test_brief_names_the_deepest_error_that_says_a_peer_is_gone() -> None:
    try:
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as e:
            raise ValueError(f"sending the record of step 3 failed ({e})") from e
    except ValueError as e:
        assert brief(e) == "Read error [127.0.0.1]:14734: Connection reset by peer"


def _exchange_after_the_peer_died(rank: int, world: int) -> dict[str, object]:
    import os

    from unbroken.errors import PeerLostError
    from unbroken.job.comm import Comm, lost_peer
    from unbroken.run.inprocess import _peer_failure

    comm = Comm(None, timedelta(seconds=30))
    assert comm.all_gather(rank) == [0, 1]
    if rank == 1:
        os._exit(0)  # gone at once, its sockets closed by the kernel
    with pytest.raises(PeerLostError) as raised:
        comm.gathered("the next step", lambda: rank)
    error = raised.value
    with pytest.raises(PeerLostError, match="lost a peer earlier"):
        comm.together("the step after", lambda: None)
    return {
        "message": str(error),
        "cause": type(error.__cause__).__name__,
        "cause_says": str(error.__cause__),
        "recognised": lost_peer(error) and _peer_failure(error),
        "lost": comm.lost,
    }


@pytest.mark.timeout(90)
def test_a_peer_gone_mid_exchange_is_one_clear_peer_lost_error() -> None:
    found = run_ranks(_exchange_after_the_peer_died, exits=[1])[0]
    message = found["message"]
    assert "\n" not in message and "GLHF" not in message and ".cc:" not in message, message
    assert "the checkpointer's process group (rank 0 of 2) lost a peer" in message
    assert "restart the job" in message
    # gloo's error, whole, is the cause: a traceback still shows it.
    assert found["cause"] in ("RuntimeError", "DistBackendError"), found
    assert any(w in str(found["cause_says"]).lower() for w in ("reset", "closed")), found
    assert found["recognised"], found  # in-process recovery: a peer's failure
    assert found["lost"] and "GLHF" not in str(found["lost"]), found
