"""Announcements and pings between the coordinator and the node agents
(`unbroken.run.news`, `unbroken.run.silence.ping`) survive a writer lost mid-write."""

from __future__ import annotations

import threading
import time

import pytest


@pytest.mark.timeout(30)
def test_a_writer_lost_mid_announce_blinds_no_listener_once_the_coordinator_looks():
    """A writer lost between its bump of the news counter and its key (a rank killed at
    the job's end, a node lost mid-announce) leaves listeners waiting on a key nobody
    sets, deaf to every later change; the coordinator's next look sets it (`heal`)."""
    from unbroken.run import coordinator, listen
    from unbroken.run.news import NEWS_KEY, Listener, announce

    raw = listen.store(timeout=10)
    agent = Listener("127.0.0.1", raw.port)
    try:
        raw.add(NEWS_KEY, 1)  # the lost writer: its key is never set
        announce(raw)
        time.sleep(0.3)
        assert not agent.take(), "the listener saw past a key that was never set"
        coordinator.Coordinator(raw).poll()  # its first poll looks
        assert agent.changed.wait(2.0), "the coordinator's look did not set the lost key"
        agent.take()
        announce(raw)
        assert agent.changed.wait(2.0), "a change after the healed one was missed"
    finally:
        agent.stop(raw)


@pytest.mark.timeout(30)
def test_a_ping_after_a_coordinator_lost_mid_ping_is_answered():
    """A coordinator lost between a ping's bump and its key (one that took over pings
    next) must not leave the agent deaf: the next ping is answered with a beat."""
    from unbroken.run import contract, listen
    from unbroken.run.news import answer_pings
    from unbroken.run.silence import ping

    raw = listen.store(timeout=10)
    stopped, pinged = threading.Event(), threading.Event()
    answerer = threading.Thread(
        target=answer_pings, args=("127.0.0.1", raw.port, "a0", stopped, pinged.set)
    )
    answerer.start()
    try:
        time.sleep(0.2)  # the answerer read the counter and waits for the first ping
        raw.add(f"{contract.AGENT_PREFIX}a0/{contract.PING_SUFFIX}", 1)  # the lost ping
        ping(raw, "a0")
        assert pinged.wait(2.0), "the ping after the lost one was not answered"
        assert int(raw.add(contract.agent_beat_key("a0"), 0)) >= 1
    finally:
        stopped.set()
        ping(raw, "a0")
        answerer.join(timeout=5.0)
