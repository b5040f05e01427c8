"""Stores that listen on one address only.

torch's `TCPStore` master listens on every interface whatever host name it is given, and
it has no authentication: anyone who reaches its port can read and write the job's keys
(generation, abort flags, process-group addresses). So unbroken binds the listening
socket itself, to the one address the job needs, and hands it to the store: the
launcher's store (`unbroken run`, one machine) on loopback, where only the job's own
processes on that machine can reach it; the coordinator's store (`unbroken coordinator`)
on loopback too, behind a gate on ``--host`` that lets in only holders of the job's
secret (`unbroken.run.gate`; docs/kubernetes.md, "Who can reach the store").
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"


def store(host: str = LOOPBACK, port: int = 0, timeout: float = 60.0) -> Any:
    """A `TCPStore` master listening on ``host:port`` only (port 0: a free one). Its
    ``port`` attribute is the port taken. `OSError` naming the address if it is taken or
    not this machine's."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        return dist.TCPStore(
            host if host not in ("0.0.0.0", "::") else LOOPBACK,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=sock.detach(),
        )
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the job's store: {e}") from e
