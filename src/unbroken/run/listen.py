"""Stores that listen on one address only.

torch's `TCPStore` master listens on every interface whatever host name it is given, and
it has no authentication: anyone who reaches its port can read and write the job's keys
(generation, abort flags, process-group addresses; torchrun's rendezvous state, a
pickle that its agents load). So unbroken binds the listening socket itself, to the one
address the job needs, and hands it to the store: the launcher's store (`unbroken run`,
one machine) and torchrun's rendezvous store on one machine on loopback, where only the
job's own processes on that machine can reach it; torchrun's rendezvous store across
machines on the address its ``--rdzv-endpoint`` names (`local_address`); the
coordinator's store (`unbroken coordinator`) on loopback too, behind a gate on
``--host`` that lets in only holders of the job's secret (`unbroken.run.gate`;
docs/kubernetes.md, "Who can reach the store").
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")


def store(
    host: str = LOOPBACK,
    port: int = 0,
    timeout: float = 60.0,
    *,
    world_size: int | None = None,
    multi_tenant: bool = False,
) -> Any:
    """A `TCPStore` master listening on ``host:port`` only (port 0: a free one). Its
    ``port`` attribute is the port taken. `OSError` naming the address if it is taken or
    not this machine's. ``world_size`` and ``multi_tenant`` as `TCPStore`'s."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        return dist.TCPStore(
            host if host not in WILDCARDS else LOOPBACK,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            multi_tenant=multi_tenant,
            master_listen_fd=sock.detach(),
        )
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the job's store: {e}") from e


def connect(host: str, port: int, timeout: float = 300.0) -> Any:
    """A client of the job's store at ``host:port``, or of its etcd cluster where ``host``
    is an ``etcd://`` URL (``port`` unused; `unbroken.run.etcd`): the same calls serve
    both."""
    if is_etcd(host):
        from unbroken.run.etcd import EtcdStore

        return EtcdStore(host, timeout)
    import torch.distributed as dist

    return dist.TCPStore(
        host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def is_etcd(address: str) -> bool:
    """Whether ``address`` is an etcd cluster's URL (`unbroken.run.etcd`)."""
    return address.startswith(("etcd://", "etcds://"))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) means this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def local_address(host: str) -> str | None:
    """The address to listen on for a store that others reach as ``host``: loopback for a
    loopback name; else the first of ``host``'s addresses that is this machine's and not
    loopback. None where there is none: ``host`` is another machine, or resolves here to
    loopback only (Debian's ``127.0.1.1`` for the machine's own name), where the other
    machines, resolving it elsewhere, could not reach a store bound there."""
    if is_loopback(host):
        return LOOPBACK if host == "localhost" else host.strip("[]")
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, address in found:
        addr = str(address[0])
        if is_loopback(addr):
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((addr, 0))  # binds only to an address this machine has
            except OSError:
                continue
        return addr
    return None


def host_store(addr: str, port: int, world_size: int, timeout: float) -> Any:
    """The store worker rank 0 hosts for its process group at torchrun's
    ``MASTER_ADDR:MASTER_PORT`` (`unbroken.run.init_process_group`), listening on the
    address ``addr`` names here (`local_address`), or on every interface, as torch's own
    store does, where it names none."""
    return store(
        local_address(addr) or "0.0.0.0",
        port,
        timeout,
        world_size=world_size,
        multi_tenant=True,  # the Checkpointer's groups may reuse the server in-process
    )
