"""`unbroken.job.gc_paused.building`: the garbage collector is paused inside and runs again after,
whatever happens inside, on however many threads, and in a child forked meanwhile."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from unbroken.errors import CorruptCheckpointError
from unbroken.format.layout import Manifest
from unbroken.job.gc_paused import building


def test_paused_inside_nested_and_running_after():
    assert gc.isenabled()
    with building():
        assert not gc.isenabled()
        with building():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block is still building
    assert gc.isenabled()


def test_runs_again_after_an_error_inside():
    with pytest.raises(ValueError), building():
        raise ValueError("boom")
    assert gc.isenabled()
    # the manifest parser builds inside it: a damaged manifest leaves it running too
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(b'{"format": "unbroken-checkpoint", "version": 2}', "m")
    assert gc.isenabled()


def test_a_collector_the_program_paused_stays_paused():
    gc.disable()
    try:
        with building():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_last_thread_to_leave_resumes_it():
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with building():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with building():
        pass
    assert not gc.isenabled()  # the other thread is still building
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_child_forked_while_building_runs_its_collector():
    with building():
        pid = os.fork()
        if pid == 0:  # the child: nobody in it will leave this block
            os._exit(0 if gc.isenabled() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
