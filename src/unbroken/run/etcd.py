"""The job's store in etcd: a control plane that no single process takes down.

    unbroken coordinator --etcd etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/job-1
    unbroken run --in-process --rdzv-endpoint etcd://10.0.0.1:2379,...,10.0.0.3:2379/job-1 ...

Why etcd, and why this way. Every agent, worker and process group of a multi-node
in-process job talks to one `torch.distributed.Store`; with the embedded coordinator that
store is a `TCPStore` in the coordinator's process, which takes the job down with it. A
store kept by a replicated log survives the loss of any one process: etcd (Raft, three
members tolerate one loss) is built for exactly this and is what Kubernetes itself keeps
its state in. Kubernetes Leases would elect a coordinator but leave its state in one
process. So the keys move to etcd and nothing else changes: `EtcdStore` is a `Store`
with the same semantics (blocking ``get``, atomic ``add`` and ``compare_set``), so the
coordinator, the agents, the workers' abort watchers and gloo's rendezvous run the same
code over either store. The coordinator keeps nothing the store does not hold
(`unbroken.run.coordinator`), so a coordinator restarted anywhere carries on, and the
agents and workers, who never talk to it, train on while it is away.

Each request goes to one member over etcd's gRPC gateway (JSON over HTTP, `etcd3gw`); a
member that fails or does not answer within `REQUEST_S` is left for the next, until the
store's timeout. A ``wait`` is a watch from the revision it last read, in slices of
`WATCH_S`, so a watch held by a member that died is replaced within a slice and no write
in between is missed.

What it does not do: authenticate. Give etcd client TLS certificates (the URL's scheme
``etcds://`` and ``$UNBROKEN_ETCD_CA``, ``..._CERT``, ``..._KEY``), or keep it on a network
that only the job reaches (docs/kubernetes.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch.distributed as dist

REQUEST_S = 2.0  # one member's time to answer one request before the next is tried
WATCH_S = 2.0
LEAD_TTL_S = 3  # a standby coordinator takes over within this long
TLS_ENV = ("UNBROKEN_ETCD_CA", "UNBROKEN_ETCD_CERT", "UNBROKEN_ETCD_KEY")
T = TypeVar("T")
_KEPT: list[EtcdStore] = []


def parse(url: str) -> tuple[str, list[tuple[str, int]], str]:
    """``(scheme, [(host, port), ...], namespace)`` of an ``etcd://h:p,h:p/namespace`` URL;
    `ValueError` saying what is wrong."""
    parts = urlsplit(url)
    hosts = [h for h in parts.netloc.split(",") if h]
    namespace = parts.path.strip("/") or "unbroken"
    if parts.scheme not in ("etcd", "etcds") or not hosts:
        raise ValueError(f"{url}: not an etcd URL; write etcd://HOST:PORT[,HOST:PORT...]/JOB")
    members = []
    for h in hosts:
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{url}: member {h!r} is not HOST:PORT")
        members.append((host.strip("[]"), int(port)))
    return ("https" if parts.scheme == "etcds" else "http"), members, namespace


class LeadLost(RuntimeError):
    """A write of a coordinator that no longer leads, refused by etcd (`EtcdStore.fence`)."""


class EtcdStore(dist.Store):
    """A `torch.distributed.Store` on an etcd cluster, every key under ``/<namespace>/``."""

    def __init__(self, url: str, timeout: float = 300.0) -> None:
        super().__init__()
        self.url = url
        self.protocol, self.members, namespace = parse(url)
        self.prefix = f"/{namespace}/"
        self.port = 0  # as `listen.connect` takes it with the URL (a TCPStore's has a port)
        self.deadline_s = timeout
        self._at = 0  # the member tried first
        self._local = threading.local()  # a client per thread: requests' sessions are not shared
        self._fence: tuple[str, str] | None = None  # (key, lease) every write depends on
        self.get_raw(["\0"])  # reach the cluster now: a wrong URL fails here, by name
        # C++ holders (a PrefixStore, gloo) call back into this object, and pybind11 finds
        # its methods only while the Python object lives: keep it (a few per generation).
        _KEPT.append(self)

    # -- torch's Store ------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        from etcd3gw.utils import _encode

        put = {"key": _encode(self._k(key)), "value": _encode(_bytes(value))}
        self._write([], [{"request_put": put}])

    def get(self, key: str) -> bytes:
        value = self.get_raw([key])[0]
        if value is None:  # torch's get waits for the key
            self.wait([key])
            value = self.get_raw([key])[0]
        return value or b""

    def add(self, key: str, amount: int) -> int:
        # A reply lost with its member, the request retried on another, counts twice: the
        # job's counters (beats, news) allow it; the generation moves by compare_set.
        return int(self._update(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: Any) -> None:
        self._update(key, lambda old: (old or b"") + _bytes(value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        want, new = _bytes(expected), _bytes(desired)
        while True:
            old, rev = self._range([key])[0][0]
            if (old is None and want) or (old is not None and old != want):
                return want if old is None else old
            if self._swap(key, rev, new):
                return new

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self.get_raw(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.get_raw(keys)
        if any(v is None for v in values):  # torch's multi_get waits for every key
            self.wait(keys)
            values = self.get_raw(keys)
        return [v or b"" for v in values]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def delete_key(self, key: str) -> bool:
        from etcd3gw.utils import _encode

        reply = self._write([], [{"request_delete_range": {"key": _encode(self._k(key))}}])
        deleted = (reply or {}).get("responses", [{}])[0].get("response_delete_range", {})
        return int(deleted.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        from etcd3gw.utils import _encode, _increment_last_byte

        end = _encode(_increment_last_byte(self.prefix))
        span = {"key": _encode(self.prefix), "range_end": end, "count_only": True}
        reply = self.request(lambda c: c.post(c.get_url("/kv/range"), json=span))
        return int(reply.get("count", 0))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Until every key exists; `RuntimeError` naming the keys after ``timeout`` (the
        store's own by default)."""
        limit = self.deadline_s if timeout is None else timeout.total_seconds()
        end = time.monotonic() + limit
        while True:
            found, revision = self._range(keys)
            missing = [k for k, (v, _) in zip(keys, found, strict=True) if v is None]
            if not missing:
                return
            left = end - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"{self.url}: keys {missing} did not appear within {limit:g} s "
                    "(wait timeout); is every rank and agent of the job running?"
                )
            self._watch(missing[0], revision + 1, min(left, WATCH_S))

    # -- etcd ---------------------------------------------------------------------------
    def create(self, key: str, value: str, lease: str) -> bool:
        """Write ``key`` bound to ``lease`` if it does not exist; whether it was written."""
        from etcd3gw.utils import _encode

        k = _encode(self._k(key))
        compare = {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        put = {"request_put": {"key": k, "value": _encode(value), "lease": lease}}
        return self._write([compare], [put]) is not None

    def fence(self, key: str, lease: str) -> None:
        """From now on every write of this store commits only while ``key`` is held on
        ``lease``, checked by etcd in the write's own transaction: a coordinator that
        lost the lead (stopped past its lease, or cut off) writes nothing more, whatever
        it was doing when it woke. Such a write raises `LeadLost`."""
        self._fence = (self._k(key), lease)

    def _write(self, compare: list[dict[str, Any]], ops: list[dict[str, Any]]) -> Any:
        """One transaction: ``ops`` if ``compare`` holds (the reply; None if it does not),
        and, once fenced, only while this store's lead holds (else `LeadLost`)."""
        from etcd3gw.utils import _encode

        fence: list[dict[str, Any]] = []
        read: list[dict[str, Any]] = []
        if self._fence is not None:
            key, lease = _encode(self._fence[0]), self._fence[1]
            fence = [{"key": key, "result": "EQUAL", "target": "LEASE", "lease": lease}]
            read = [{"request_range": {"key": key}}]
        txn = {"compare": [*compare, *fence], "success": ops, "failure": read}
        reply = self.request(lambda c: c.transaction(txn))
        if reply.get("succeeded", False):
            return reply
        if self._fence is not None:
            kvs = reply.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
            if not kvs or str(kvs[0].get("lease")) != str(self._fence[1]):
                raise LeadLost(
                    f"{self.url}: this coordinator no longer leads the job (its etcd lease "
                    "expired or was revoked): another coordinator decides now"
                )
        return None

    def get_raw(self, keys: list[str]) -> list[bytes | None]:
        return [value for value, _ in self._range(keys)[0]]

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _range(self, keys: list[str]) -> tuple[list[tuple[bytes | None, int]], int]:
        """Each key's value (None where absent) and the revision it was last written at
        (0 where absent), and the store's revision, in one request."""
        from etcd3gw.utils import _decode, _encode

        ops = [{"request_range": {"key": _encode(self._k(k))}} for k in keys]
        reply = self.request(lambda c: c.transaction({"compare": [], "success": ops}))
        found: list[tuple[bytes | None, int]] = []
        for response in reply.get("responses", []):
            kvs = response.get("response_range", {}).get("kvs", [])
            kv = kvs[0] if kvs else None
            found.append(
                (None, 0) if kv is None else (_decode(kv.get("value", "")), int(kv["mod_revision"]))
            )
        return found, int(reply["header"]["revision"])

    def _swap(self, key: str, revision: int, value: bytes) -> bool:
        """Write ``value`` if ``key`` was last written at ``revision`` (0: absent)."""
        from etcd3gw.utils import _encode

        k = _encode(self._k(key))
        compare = {"key": k, "result": "EQUAL", "target": "MOD", "mod_revision": revision}
        put = {"request_put": {"key": k, "value": _encode(value)}}
        return self._write([compare], [put]) is not None

    def _update(self, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        while True:  # optimistic: retried only when another writer came in between
            old, rev = self._range([key])[0][0]
            new = change(old)
            if self._swap(key, rev, new):
                return new

    def _watch(self, key: str, revision: int, timeout: float) -> None:
        """Until ``key`` is written at ``revision`` or later, or ``timeout`` passed (no
        error: the caller reads again). A member that fails before the watch starts is
        left like any other; one that fails during it ends the watch, and the caller's
        next read finds another."""
        import requests
        from etcd3gw.utils import _encode

        body = {"create_request": {"key": _encode(self._k(key)), "start_revision": revision}}

        def once(c: Any) -> None:
            # etcd3gw's own watch has no timeout: a stopped member would hold it forever.
            with c.session.post(
                c.get_url("/watch"), json=body, stream=True, timeout=(REQUEST_S, timeout)
            ) as reply:
                try:
                    for line in reply.iter_lines():
                        if line and "events" in json.loads(line).get("result", {}):
                            return
                except (requests.exceptions.RequestException, ValueError):
                    return  # the slice is over, or the member went away: read again

        self.request(once)

    def _client(self, member: int) -> Any:
        from etcd3gw import Etcd3Client

        clients = self._local.__dict__.setdefault("clients", {})
        if member not in clients:
            host, port = self.members[member]
            ca, cert, key = (os.environ.get(v) for v in TLS_ENV)
            clients[member] = Etcd3Client(
                host, port, self.protocol, ca, key, cert, REQUEST_S, api_path="/v3/"
            )
        return clients[member]

    def request(self, request: Callable[[Any], T]) -> T:
        """``request`` on a member that answers, trying each in turn until the store's
        timeout: a member that died or lost its quorum is left for another."""
        import requests
        from etcd3gw.exceptions import Etcd3Exception

        end = time.monotonic() + self.deadline_s
        tried: list[str] = []
        while True:
            member = self._at
            try:
                return request(self._client(member))
            except (Etcd3Exception, requests.exceptions.RequestException) as e:
                why = getattr(e, "detail_text", None) or str(e) or type(e).__name__
                if "Errno" in why:  # requests' text; its last part says what happened
                    why = why[why.rindex("[Errno") :].split('"')[0].split("'")[0].rstrip(")")
                tried.append(f"{self.members[member][0]}:{self.members[member][1]} ({why})")
            self._at = (member + 1) % len(self.members)
            if time.monotonic() > end:
                raise RuntimeError(
                    f"{self.url}: no etcd member answered within {self.deadline_s:g} s: "
                    f"{'; '.join(tried[-len(self.members) :])}; start etcd, or check the URL"
                )
            if self._at == 0:
                time.sleep(0.1)  # every member failed once: the cluster may be electing


class Lead:
    """This process's hold on the job's ``coordinator`` key, on an etcd lease: at most one
    coordinator of a job decides at a time, and a standby coordinator takes over within
    ``ttl`` seconds of the leader's loss. The leader renews the lease as it polls
    (`keep`); one that was stopped longer than ``ttl`` finds it expired and steps down.
    Its store is fenced on the lease (`EtcdStore.fence`): a write it makes meanwhile, in
    the middle of a decision, is refused by etcd (`LeadLost`)."""

    KEY = "unbroken/coordinator"

    def __init__(self, store: EtcdStore, ttl: int = LEAD_TTL_S) -> None:
        self.store, self.ttl = store, ttl
        self.me = f"{socket.gethostname()}:{os.getpid()}"
        self.lease = ""
        self.renewed = -math.inf

    def take(self, say: Callable[[str], None]) -> None:
        """Block until this process leads (saying once who leads meanwhile)."""
        said = False
        while True:
            grant = self.store.request(
                lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": self.ttl})
            )
            self.lease, self.renewed = grant["ID"], time.monotonic()
            if self.store.create(self.KEY, self.me, self.lease):
                return
            self.release()
            if not said:
                holder = self.store.get_raw([self.KEY])[0]
                say(f"coordinator {(holder or b'?').decode()} leads: standing by to take over")
                said = True
            time.sleep(self.ttl / 4)

    def keep(self) -> bool:
        """Renew the lease every ``ttl``/4 seconds; False once it has expired."""
        now = time.monotonic()
        if now - self.renewed < self.ttl / 4:
            return True
        reply = self.store.request(
            lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": self.lease})
        )
        if int(reply.get("result", {}).get("TTL", 0)) <= 0:
            return False
        self.renewed = now
        return True

    def release(self) -> None:
        """Give the lead up at once (a standby need not wait for the lease to expire)."""
        with contextlib.suppress(Exception):
            revoke = {"ID": self.lease}
            self.store.request(lambda c: c.post(c.get_url("/lease/revoke"), json=revoke))


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
