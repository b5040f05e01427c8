"""The job's store in etcd: no process's loss stops a multi-node in-process job.

A real 3-member etcd cluster on loopback (Debian's ``etcd-server``); two ``unbroken
coordinator --etcd`` processes, one leading and one standing by; two node agents of 2
ranks each with ``--rdzv-endpoint etcd://...``, each its own process tree, as in
tests/test_multinode.py. Faults: the leading coordinator killed mid-run, with no
coordinator at all for a while; the coordinator and a node killed together; an etcd
member killed during a recovery. Every run ends bitwise equal to an uninterrupted one,
and no rank that was not lost restarts.

CI sets ``UNBROKEN_REQUIRE_ETCD=1`` (and installs etcd-server); elsewhere these tests
skip when there is no ``etcd`` on the PATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from servers.etcd import ETCD, LocalEtcd
from test_multinode import ENV, STEPS, Cluster, check, log_fd, lose_node

if ETCD is None and os.environ.get("UNBROKEN_REQUIRE_ETCD") == "1":
    raise RuntimeError("UNBROKEN_REQUIRE_ETCD=1 but no `etcd` on the PATH: apt install etcd-server")
pytestmark = pytest.mark.skipif(ETCD is None, reason="no etcd (apt install etcd-server)")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    cluster = LocalEtcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield cluster
    finally:
        cluster.close()


class EtcdJob(Cluster):
    """`Cluster` with its store in ``etcd``: a leading coordinator, and a standby one
    unless ``standby`` is False."""

    def __init__(
        self, tmp: Path, etcd: LocalEtcd, *options: str, steps: int, standby: bool
    ) -> None:
        self.etcd, self.standby = etcd, standby
        super().__init__(tmp, *options, steps=steps)

    def coordinate(self) -> subprocess.Popen[str]:
        self.endpoint = self.etcd.url(self.job)
        leader = self.start_coordinator()
        assert leader.stdout is not None
        line = leader.stdout.readline()
        assert "leading the job" in line, line + self.log()
        if self.standby:
            self.start_coordinator()
        return leader

    def start_coordinator(self) -> subprocess.Popen[str]:
        n = len(self.coordinators)
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "unbroken", "coordinator", f"--etcd={self.endpoint}"),
                *("--node-timeout=3", "--answer-timeout=1", "--exit-when-done"),
            ],
            stdout=subprocess.PIPE,
            stderr=(err := log_fd(self.tmp / f"coordinator-{n}.err")),
            text=True,
            env=ENV,
            start_new_session=True,
        )
        os.close(err)
        self.coordinators.append(proc)
        return proc

    def step(self) -> int:
        """Rank 0's newest step, from its heartbeat (node 0's run directory)."""
        try:
            return int((self.run_dir(0) / "rank-0").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return -1


@pytest.fixture
def job(tmp_path: Path, etcd: LocalEtcd) -> Iterator[object]:
    made: list[EtcdJob] = []

    def make(*options: str, steps: int = STEPS, standby: bool = True) -> EtcdJob:
        made.append(
            EtcdJob(tmp_path / f"run-{len(made)}", etcd, *options, steps=steps, standby=standby)
        )
        return made[-1]

    yield make
    for c in made:
        c.close()


# -- the store itself ---------------------------------------------------------------------


def test_the_etcd_store_answers_as_torchs_store_does(etcd):
    """The same calls on a TCPStore and on the etcd store give the same answers:
    blocking get, counters, compare-and-set, append, check, wait's timeout."""
    from unbroken.run import listen
    from unbroken.run.etcd import EtcdStore

    tcp, url = listen.store(), etcd.url(f"sem-{os.getpid()}")
    stores = {"tcp": tcp, "etcd": EtcdStore(url, timeout=5)}
    # Another connection sets the key that a blocking get waits for.
    others = {"tcp": listen.connect("127.0.0.1", tcp.port), "etcd": EtcdStore(url)}
    answers: dict[str, list[object]] = {}
    for name, s in stores.items():
        late = threading.Timer(0.3, lambda o=others[name]: o.set("late", b"x"))
        late.start()
        got: list[object] = [s.get("late")]  # blocks until it is set
        s.set("a", "1")
        got += [s.get("a"), s.check(["a"]), s.check(["a", "b"]), s.add("n", 2), s.add("n", -1)]
        got += [
            s.compare_set("c", "", "v"),
            s.compare_set("c", "w", "z"),
            s.compare_set("c", "v", "y"),
        ]
        got += [s.compare_set("absent", "q", "z"), s.check(["absent"])]
        s.append("l", "1,")
        s.append("l", "2,")
        got += [s.get("l"), s.multi_get(["a", "l"]), s.delete_key("a"), s.check(["a"])]
        t = time.monotonic()
        with pytest.raises(RuntimeError):  # torch's DistStoreError is one
            s.wait(["never"], timedelta(seconds=0.5))
        got.append(round(time.monotonic() - t))
        answers[name] = got
    assert answers["etcd"] == answers["tcp"]


def test_the_etcd_store_goes_on_when_a_member_dies(etcd):
    from unbroken.run.etcd import EtcdStore

    store = EtcdStore(etcd.url(f"member-{os.getpid()}"), timeout=20)
    store.set("before", "1")
    etcd.kill(0)  # the member every client asks first
    try:
        t = time.monotonic()
        assert store.add("n", 1) == 1 and store.get("before") == b"1"
        assert time.monotonic() - t < 10
    finally:
        etcd.start(0)


def test_a_coordinator_that_lost_its_lead_writes_nothing(etcd):
    """A leading coordinator stopped past its lease (here: the lease revoked under it, as
    its expiry would) wakes and writes: etcd refuses every kind of write in the write's
    own transaction, so nothing it decides lands, and the new leader's writes do."""
    from unbroken.run.etcd import EtcdStore, Lead, LeadLost

    url = etcd.url(f"fence-{os.getpid()}")
    old, new = EtcdStore(url, timeout=10), EtcdStore(url, timeout=10)
    first = Lead(old)
    first.take(print)
    old.fence(Lead.KEY, first.lease)
    old.set("decided", "by the first")
    assert old.add("count", 2) == 2 and old.delete_key("count")
    first.release()  # its lease gone, as when it expires while the process is stopped
    second = Lead(new)
    second.take(print)
    new.fence(Lead.KEY, second.lease)
    writes = {
        "set": lambda: old.set("decided", "by the old"),
        "add": lambda: old.add("count", 1),
        "compare_set": lambda: old.compare_set("decided", "by the first", "by the old"),
        "delete_key": lambda: old.delete_key("decided"),
    }
    for name, write in writes.items():
        with pytest.raises(LeadLost, match="no longer leads"):
            write()
        assert new.get_raw(["decided", "count"]) == [b"by the first", None], name
    new.set("decided", "by the second")
    assert new.get_raw(["decided"]) == [b"by the second"]
    second.release()


def test_a_wrong_etcd_url_is_named():
    from unbroken.run.etcd import EtcdStore, parse

    with pytest.raises(ValueError, match="not HOST:PORT"):
        parse("etcd://localhost/job")
    with pytest.raises(RuntimeError, match=r"no etcd member answered.*127\.0\.0\.1:1 "):
        EtcdStore("etcd://127.0.0.1:1/job", timeout=0.5)


# -- a job on it ----------------------------------------------------------------------


@pytest.mark.timeout(240)  # with conftest's reference run
def test_the_coordinator_killed_mid_run_stops_no_rank(job, reference):
    """The only coordinator is killed at step 5: the ranks train on with no coordinator
    for 4 steps and more, a new one (as a Deployment would start it) takes over, and the
    job ends bitwise with every rank in its first process, in generation 0."""
    c = job(standby=False)
    c.agent(0)
    c.agent(1)
    c.wait_for(lambda: c.step() >= 5, timeout=60)
    c.coordinator.kill()
    c.coordinator.wait()
    killed_at = c.step()
    c.wait_for(lambda: c.step() >= killed_at + 4, timeout=30)  # no coordinator meanwhile
    c.coordinator = c.start_coordinator()
    run = c.finish()
    assert run["params"] == reference["params"], "not bitwise equal"
    assert len(run["starts"]) == 4 and {s["seen_generation"] for s in run["starts"]} == {0}
    assert "took over at generation 0" in c.text(), c.log()


@pytest.mark.timeout(180)
def test_a_node_lost_with_the_coordinator_heals_once_the_standby_leads(job, reference):
    """Node 1 and the leading coordinator die together: the standby coordinator takes
    the lead, finds node 1 lost, and the replacement heals from live replicas."""
    c = job("--inject-fault=kill-node node=1 step=11")
    c.agent(0)
    c.agent(1)
    lose_node(c, 1, then=lambda: (c.coordinator.kill(), c.coordinator.wait()))
    c.coordinator = c.coordinators[1]
    run = c.finish()
    check(run, reference, replaced={2, 3})
    assert "took over at generation 0" in c.text(), c.log()


@pytest.mark.timeout(180)
def test_an_etcd_member_lost_during_a_recovery(job, reference, etcd):
    """Node 1 is lost; while the job recovers, the etcd member every client asks first
    is killed: the recovery completes on the other two, bitwise, healed live."""
    c = job("--inject-fault=kill-node node=1 step=11", standby=False)
    c.agent(0)
    c.agent(1)
    try:
        lose_node(c, 1, then=lambda: etcd.kill(0))
        run = c.finish()
    finally:
        etcd.start(0)
    check(run, reference, replaced={2, 3})


def test_the_coordinator_refuses_a_wrong_etcd_url_saying_why():
    done = subprocess.run(
        [sys.executable, "-m", "unbroken", "coordinator", "--etcd", "etcd://nohost/job"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "member 'nohost' is not HOST:PORT" in done.stderr, done.stderr
