"""The coordinator's gate: only holders of the job's secret reach its store.

torch's `TCPStore` has no authentication, and its clients (every worker's process group,
every node agent) cannot present any. So across machines no client talks to the store
directly. The coordinator's store listens on loopback only, and a `Gate` listens on
``--host``: for each connection it runs a challenge-response with the job's shared
secret, then passes bytes both ways between the connection and the store. On each node
the agent runs a `Relay` on loopback, which the node's agent and workers use as the
coordinator's address: for each connection it opens one to the gate, answers the
challenge, and passes bytes likewise.

The handshake: the gate sends a fresh random nonce; the relay answers with its own nonce
and an HMAC-SHA256 of both under the secret; the gate checks it (in constant time) and
proves that it holds the secret too, with an HMAC over the nonces in the other order.
Neither side ever sends the secret, and a recorded handshake is worthless (fresh nonces).
The bytes after the handshake are not encrypted: a network that can be observed still
sees the store's traffic (addresses, generation numbers, no training data). A peer that
fails the handshake, or sends nothing within `HANDSHAKE_S`, is disconnected having read
nothing.

The secret: ``$UNBROKEN_JOB_SECRET``, else the file named by ``--secret-file`` (readable
by its owner only), the same on the coordinator and every node. `job_secret` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import threading
from collections.abc import Awaitable, Callable

SECRET_ENV = "UNBROKEN_JOB_SECRET"
MIN_SECRET = 16  # bytes: shorter secrets can be guessed
HANDSHAKE_S = 5.0
_HELLO = b"unbroken-gate/1\n"  # 16 bytes: a client of some other protocol fails at once
_NONCE = 32
_CHUNK = 1 << 16


class GateError(RuntimeError):
    """The secret is missing, unsafe, or does not match the other side's."""


def job_secret(path: str | None = None) -> bytes | None:
    """The job's secret: ``$UNBROKEN_JOB_SECRET``, else the contents of ``path``; None if
    neither is given. `GateError` if it is too short, or the file is readable by others."""
    value = os.environ.get(SECRET_ENV)
    where = f"${SECRET_ENV}"
    if value is None and path is not None:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise GateError(
                f"{path}: the job's secret is readable by others (mode {stat.S_IMODE(mode):o}); "
                f"`chmod 600 {path}`"
            )
        with open(path) as f:
            value, where = f.read().strip(), path
    if value is None:
        return None
    if len(value.encode()) < MIN_SECRET:
        raise GateError(
            f"{where}: the job's secret has {len(value.encode())} bytes, fewer than "
            f"{MIN_SECRET}; make one with `openssl rand -hex 32`"
        )
    return value.encode()


def relay_to(host: str, port: int, secret_file: str | None) -> Relay | None:
    """A loopback relay to the gate at ``host:port`` if the job has a secret, else None."""
    secret = job_secret(secret_file)
    return None if secret is None else Relay(host, port, secret)


def new_secret() -> str:
    """A fresh secret (for a launch that plays every node itself)."""
    return secrets.token_hex(32)


def _mac(secret: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, side + first + second, hashlib.sha256).digest()


class _Server:
    """An asyncio server on its own daemon thread: ``handle(reader, writer)`` per
    connection. `port` is the port it listens on."""

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    ) -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            try:
                server = await asyncio.start_server(handle, host, port, reuse_address=True)
            except OSError as e:
                failure.append(OSError(f"cannot listen on {host}:{port}: {e}"))
                started.set()
                return
            self.port = int(server.sockets[0].getsockname()[1])
            started.set()
            async with server:
                await server.serve_forever()

        self._thread = threading.Thread(
            target=self.loop.run_until_complete, args=(serve(),), name="unbroken-gate", daemon=True
        )
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]


async def _splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                  b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:  # fmt: skip
    """Pass bytes both ways until either side closes; then close both."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()

    tasks = [asyncio.ensure_future(pipe(a[0], b[1])), asyncio.ensure_future(pipe(b[0], a[1]))]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()
    for writer in (a[1], b[1]):
        writer.close()


class Gate(_Server):
    """Listens on ``host:port`` (0: any free port); lets through to the store at
    ``127.0.0.1:store_port`` only the connections that prove they hold ``secret``."""

    def __init__(self, host: str, port: int, store_port: int, secret: bytes) -> None:
        self.secret, self.store_port = secret, store_port
        self.refused = 0  # connections that failed the handshake
        super().__init__(host, port, self._handle)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = secrets.token_bytes(_NONCE)
        try:
            writer.write(_HELLO + nonce)
            answer = await asyncio.wait_for(
                reader.readexactly(len(_HELLO) + _NONCE + 32), HANDSHAKE_S
            )
            theirs, mac = answer[len(_HELLO) : len(_HELLO) + _NONCE], answer[-32:]
            if answer[: len(_HELLO)] != _HELLO or not hmac.compare_digest(
                mac, _mac(self.secret, b"client", nonce, theirs)
            ):
                raise GateError("wrong secret")
            writer.write(_mac(self.secret, b"server", theirs, nonce))
            store = await asyncio.open_connection("127.0.0.1", self.store_port)
        except (TimeoutError, GateError, asyncio.IncompleteReadError, OSError):
            self.refused += 1
            writer.close()
            return
        await _splice((reader, writer), store)


class Relay(_Server):
    """Listens on loopback; passes each connection to the gate at ``host:port`` once it
    has answered the gate's challenge with ``secret``. `port` is the local port."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self.remote, self.secret = (host, port), secret
        self.failure: str | None = None  # why the last handshake failed, if one did
        super().__init__("127.0.0.1", 0, self._handle)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.remote
        try:
            gate = await asyncio.wait_for(asyncio.open_connection(host, port), HANDSHAKE_S)
            hello = await asyncio.wait_for(gate[0].readexactly(len(_HELLO) + _NONCE), HANDSHAKE_S)
            if hello[: len(_HELLO)] != _HELLO:
                raise GateError(f"{host}:{port} is not an unbroken coordinator's gate")
            theirs, mine = hello[len(_HELLO) :], secrets.token_bytes(_NONCE)
            gate[1].write(_HELLO + mine + _mac(self.secret, b"client", theirs, mine))
            proof = await asyncio.wait_for(gate[0].readexactly(32), HANDSHAKE_S)
            if not hmac.compare_digest(proof, _mac(self.secret, b"server", mine, theirs)):
                raise GateError(f"{host}:{port} does not hold the job's secret")
        except asyncio.IncompleteReadError:
            self.failure = (
                f"the coordinator at {host}:{port} refused this node: is it started with "
                f"the same ${SECRET_ENV} (or --secret-file)?"
            )
            writer.close()
            return
        except (TimeoutError, GateError, OSError) as e:
            self.failure = f"the coordinator at {host}:{port}: {e or 'no answer'}"
            writer.close()
            return
        await _splice((reader, writer), gate)
