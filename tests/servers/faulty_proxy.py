"""An HTTP proxy in front of a real S3 server that injects faults on request: 503 SlowDown
replies, connections dropped in the middle of a request, and delayed replies."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Fault:
    kind: str  # "503", "drop" or "delay"
    matches: Callable[[str, str], bool]  # (method, path) -> bool
    times: int  # how many matching requests it hits
    seconds: float = 0.0
    hits: int = 0


@dataclass
class FaultyProxy:
    upstream: str
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def inject(
        self, kind: str, matches: Callable[[str, str], bool], times: int = 1, seconds: float = 0
    ) -> Fault:
        fault = Fault(kind, matches, times, seconds)
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self.lock:
            self.requests.append((method, path))
            for fault in self.faults:
                if fault.hits < fault.times and fault.matches(method, path):
                    fault.hits += 1
                    return fault
        return None

    def start(self) -> str:
        proxy = self
        target = urlsplit(self.upstream)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                fault = proxy._fault_for(self.command, self.path)
                if fault is not None and fault.kind == "drop":
                    self.rfile.read(length // 2)  # take half the body, then vanish
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                body = self.rfile.read(length) if length else b""
                if fault is not None and fault.kind == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                if fault is not None and fault.kind == "delay":
                    time.sleep(fault.seconds)
                conn = http.client.HTTPConnection(
                    target.hostname or "127.0.0.1", target.port, timeout=60
                )
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status, reply.reason)
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                length_header = reply.getheader("Content-Length", "0")
                self.send_header(
                    "Content-Length", length_header if self.command == "HEAD" else str(len(data))
                )
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
