"""Stores bound to where they are needed (issue 32, item 6; the messages, item 7, are
tests/test_run_messages.py).

Every store that ``unbroken run`` creates, or makes torchrun create, is looked at the way
an attacker would: the listening sockets of the job's real process tree, read from
/proc while the job runs.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from unbroken.run.procs import descendants

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_JOB_SECRET": secrets.token_hex(32)}

# A restart-mode worker that joins its process group (worker rank 0 hosts its store),
# says it is ready, and holds until the test releases it.
HOLD = """
import os, time
import unbroken.run
unbroken.run.init_process_group(timeout_s=60)
unbroken.run.tick(0)
here = os.environ["BOUND_DIR"]
open(os.path.join(here, f"ready-{os.getpid()}"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(here, "release")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""
# -- listening sockets, read from /proc -------------------------------------------------


def _address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of /proc/net/tcp{,6}: hex, each 32-bit word in the machine's order."""
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    step = -1 if sys.byteorder == "little" else 1
    words = b"".join(raw[i : i + 4][::step] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words), int(port, 16)


def listening(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    """pid -> the (address, port) each of its TCP sockets listens on."""
    owner: dict[int, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owner[int(link[8:-1])] = pid
        except OSError:
            continue  # exited meanwhile
    found: dict[int, list[tuple[str, int]]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[9]) in owner:  # 0A: LISTEN
                addr, port = _address(fields[1])
                found.setdefault(owner[int(fields[9])], []).append((str(addr), port))
    return found


def wildcard(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_unspecified or bool(mapped and mapped.is_unspecified)


def outward_address() -> str | None:
    """This machine's address on its default route, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent: only the route is looked up
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Launch:
    """A restart-mode ``unbroken run`` of `HOLD` with ``workers`` ranks; `look` returns,
    once every rank is ready, the tree's listening sockets: launcher and agents' and the
    workers' apart."""

    def __init__(self, tmp: Path, *options: str, workers: int = 2) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.dir, self.workers = tmp, workers
        (tmp / "hold.py").write_text(HOLD)
        self.err = tmp / "launch.err"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "unbroken.run", *options, str(tmp / "hold.py")],
                env={**ENV, "BOUND_DIR": str(tmp)},
                stderr=err,
                start_new_session=True,
            )

    def look(self) -> tuple[dict, dict]:
        deadline = time.monotonic() + 60
        while len(list(self.dir.glob("ready-*"))) < self.workers:
            assert self.proc.poll() is None, self.err.read_text()[-3000:]
            assert time.monotonic() < deadline, self.err.read_text()[-3000:]
            time.sleep(0.1)
        workers = {int(p.name.split("-")[1]) for p in self.dir.glob("ready-*")}
        found = listening([self.proc.pid, *descendants(self.proc.pid)])
        ours = {pid: a for pid, a in found.items() if pid not in workers}
        return ours, {pid: a for pid, a in found.items() if pid in workers}

    def finish(self) -> None:
        (self.dir / "release").touch()
        assert self.proc.wait(timeout=60) == 0, self.err.read_text()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    made: list[Launch] = []
    yield made
    for launch in made:
        launch.close()


# -- item 6: stores bound to where they are needed --------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "options",
    [
        ["--nproc-per-node=2"],
        ["--standalone", "--nproc-per-node=2"],
        ["--simulate-nodes=2", "--nproc-per-node=1", "--max-restarts=1"],
    ],
    ids=["default", "standalone", "simulated-nodes"],
)
def test_restart_mode_rendezvous_store_listens_on_loopback_only(tmp_path, launches, options):
    """torchrun's c10d rendezvous store (a pickle every agent loads) is the launcher's,
    on loopback: no process of the launcher and its torchrun agents listens on every
    interface, or on anything but loopback."""
    launches.append(launch := Launch(tmp_path, *options))
    ours, _ = launch.look()
    assert launch.proc.pid in ours, f"the launcher hosts no store: {ours}"
    for pid, addresses in ours.items():
        for addr, port in addresses:
            assert ipaddress.ip_address(addr).is_loopback, f"pid {pid} listens on {addr}:{port}"
    launch.finish()


@pytest.mark.timeout(90)
def test_restart_mode_worker_rank_0s_store_listens_on_loopback_only(tmp_path, launches):
    launches.append(launch := Launch(tmp_path, "--nproc-per-node=2"))
    _, workers = launch.look()
    wild = [(pid, a) for pid, found in workers.items() for a in found if wildcard(a[0])]
    launch.finish()
    assert not wild, f"workers listen on every interface: {wild}"


@pytest.mark.timeout(60)
def test_the_process_group_store_listens_on_its_master_addr_only():
    """`listen.host_store`, what worker rank 0 hosts at MASTER_ADDR:MASTER_PORT: only that
    address reaches it, and a gloo group (and a second group on the same server, as the
    Checkpointer's) works through it."""
    import torch
    import torch.distributed as dist

    from unbroken.run import listen

    store = listen.host_store("127.0.0.1", free_port(), 1, timeout=10)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", store.port), timeout=2).close()
    assert listen.local_address("localhost") == "127.0.0.1"
    assert listen.local_address("192.0.2.77") is None  # TEST-NET: no address of ours
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        group = dist.new_group([0])
        dist.all_reduce(t, group=group)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    assert client.check(["pg/0"]) is not None


@pytest.mark.timeout(90)
def test_across_machines_the_rendezvous_store_listens_on_the_endpoints_address(tmp_path, launches):
    """Two nodes' launchers, the first hosting the c10d store (``is_host=true``): it
    listens on the endpoint's address alone, which loopback does not reach, and no
    launcher or agent of either node listens on every interface."""
    addr = outward_address()
    if addr is None:
        pytest.skip("this machine has no address but loopback")
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={addr}:{port}",
        f"--rdzv-id=bound-{port}",
        f"--local-addr={addr}",
    ]
    for i, host in enumerate(["true", "false"]):
        conf = f"--rdzv-conf=is_host={host}"
        launches.append(Launch(tmp_path / f"node-{i}", *common, conf, workers=1))
    ours = {}
    for launch in launches:
        ours.update(launch.look()[0])
    assert (addr, port) in ours.get(launches[0].proc.pid, []), ours
    for pid, addresses in ours.items():
        assert not [a for a in addresses if wildcard(a[0])], f"pid {pid}: {addresses}"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    for launch in launches:
        (launch.dir / "release").touch()
    for launch in launches:
        launch.finish()


def test_bind_rendezvous_keeps_what_the_user_gave():
    """The options the launcher gives torchrun: one node's rendezvous on its own loopback
    store with the user's --rdzv-conf kept (is_host forced off: the store is ours);
    what it does not host (etcd, a node that is not the host) unchanged."""
    from unbroken.run.args import torchrun_parser
    from unbroken.run.launch import bind_rendezvous

    def bound(*opts: str) -> tuple[list[str], object]:
        return bind_rendezvous(list(opts), torchrun_parser().parse_args([*opts, "x.py"]))

    opts, store = bound("--standalone", "--rdzv-conf=read_timeout=9", "--nproc-per-node=2")
    assert store is not None and "--standalone" not in opts
    assert f"--rdzv-endpoint=127.0.0.1:{store.port}" in opts  # type: ignore[attr-defined]
    assert "--rdzv-conf=read_timeout=9,is_host=false" in opts
    assert "--local-addr=127.0.0.1" in opts and "--nproc-per-node=2" in opts
    opts, store = bound("--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--rdzv-id=j")
    assert store is not None and "--rdzv-id=j" in opts
    etcd = ["--nnodes=2", "--rdzv-backend=etcd-v2", "--rdzv-endpoint=e:2379"]
    assert bound(*etcd) == (etcd, None)
    guest = ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=192.0.2.77:29400"]
    assert bound(*guest) == (guest, None)
