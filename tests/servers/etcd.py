"""A throwaway etcd cluster on loopback, for tests and benches (Debian's ``etcd-server``).

etcd = LocalEtcd(tmp_path)             # 3 members, a leader elected
store = EtcdStore(etcd.url("job-1"))   # unbroken.run.etcd
etcd.kill(0); etcd.start(0)            # lose a member, bring it back
etcd.close()
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

ETCD = shutil.which("etcd")


def log_fd(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class LocalEtcd:
    """A 3-member etcd cluster on loopback; members can be killed and started again."""

    def __init__(self, root: Path, members: int = 3) -> None:
        self.root = root
        ports = free_ports(2 * members)
        self.clients, self.peers = ports[:members], ports[members:]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        for i in range(members):
            self.start(i)
        from unbroken.run.etcd import EtcdStore

        EtcdStore(self.url("up"), timeout=30).set("up", "1")  # a leader was elected

    def url(self, job: str) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.clients) + f"/{job}"

    def start(self, i: int) -> None:
        peers = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peers))
        client = f"http://127.0.0.1:{self.clients[i]}"
        cmd = [
            str(ETCD),
            f"--name=m{i}",
            f"--data-dir={self.root / f'm{i}'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls=http://127.0.0.1:{self.peers[i]}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{self.peers[i]}",
            f"--initial-cluster={peers}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=unbroken-test",
            # A loaded CI machine must not lose its leader to a late heartbeat.
            "--heartbeat-interval=100",
            "--election-timeout=2000",
        ]
        err = log_fd(self.root / f"etcd-m{i}.err")
        self.procs[i] = subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL)
        os.close(err)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.kill()
        proc.wait()

    def close(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
