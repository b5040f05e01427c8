"""How to reach a bucket: the options of the S3 backend, checked when they are given."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from unbroken.errors import CheckpointError

_MIB = 1 << 20
# Where an endpoint comes from when no option names one: the AWS SDKs' variables (the S3
# one first), then object_store's; and object_store's opt-in to plain HTTP.
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
ALLOW_HTTP_ENV = "AWS_ALLOW_HTTP"


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """How to reach a bucket. Credentials default to the usual AWS chain (environment,
    ``~/.aws`` config and credentials files, SSO, instance roles); given here, they never
    appear in a repr, an error or a log line.

    Requests use TLS: an ``http://`` endpoint is refused unless its host is a loopback
    address (``127.0.0.0/8``, ``::1``, ``localhost``: a server on this machine, allowed by
    default) or ``allow_http=True`` says plain HTTP is wanted (credentials' signatures and
    the checkpoint's bytes then cross the network unencrypted). Without an ``endpoint``,
    the environment's applies (`with_environment`)."""

    endpoint: str | None = None  # e.g. "http://127.0.0.1:7480"; default: AWS
    allow_http: bool = False  # plain HTTP to an endpoint that is not loopback
    region: str | None = None
    # https://endpoint/bucket/key instead of https://bucket.endpoint/key; None: path style
    # for an endpoint given as an IP address or localhost, as boto3 does
    path_style: bool | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    part_size: int = 16 * _MIB  # multipart part size, and ranged-GET piece size
    concurrency: int = 16  # parts in flight per object, for uploads and downloads
    timeout: float = 60.0  # seconds for one request
    retry_timeout: float = 120.0  # seconds after the first attempt when retries stop
    max_retries: int = 10

    def __post_init__(self) -> None:
        if self.part_size < 5 * _MIB:
            raise ValueError(f"part_size={self.part_size}: S3 parts must be at least 5 MiB")
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency}: at least one request at a time")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither")
        if self.endpoint and (problem := endpoint_problem(self.endpoint)):
            raise ValueError(f"endpoint {self.endpoint!r} {problem}")
        if self.endpoint and not self.allow_http and _plain_remote(self.endpoint):
            raise ValueError(
                f"endpoint {self.endpoint} is plain HTTP to a host that is not this machine: "
                "credentials and checkpoints would cross the network unencrypted. Use "
                "https://, or pass allow_http=True if that is what you want"
            )
        if self.path_style is False and self.endpoint and path_style_by_default(self.endpoint):
            host = urlsplit(self.endpoint).hostname
            if host != "localhost":
                raise ValueError(
                    f"path_style=False puts the bucket in the host name, and {self.endpoint} "
                    "is an IP address: leave path_style out (an IP endpoint takes path-style "
                    "requests by itself), or name the server by a host name"
                )

    @property
    def uses_path_style(self) -> bool:
        if self.path_style is None:
            return path_style_by_default(self.endpoint)
        return self.path_style

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> S3Options:
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(options) - known):
            raise ValueError(f"unknown S3 storage options {unknown}; known: {sorted(known)}")
        return cls(**options)


def with_environment(options: S3Options) -> S3Options:
    """``options`` with the endpoint the environment names (`ENDPOINT_ENV`) when they
    name none, on the same rule: plain HTTP to a host that is not this machine needs
    ``AWS_ALLOW_HTTP=true``, as an option's needs ``allow_http=True``.

    obstore reads these variables itself, but unbroken must know the endpoint to address
    the bucket (path-style on an IP address) and to name it in errors, and the client
    options unbroken passes would drop the environment's ``AWS_ALLOW_HTTP``."""
    if options.endpoint:
        return options
    found = [(name, os.environ[name]) for name in ENDPOINT_ENV if os.environ.get(name)]
    if not found:
        return options
    name, endpoint = found[0]
    if problem := endpoint_problem(endpoint):
        raise CheckpointError(f"{name}={endpoint} {problem}")
    allow = os.environ.get(ALLOW_HTTP_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if _plain_remote(endpoint) and not allow:
        raise CheckpointError(
            f"{name}={endpoint} is plain HTTP to a host that is not this machine: "
            "credentials and checkpoints would cross the network unencrypted. Use "
            f"https://, or set {ALLOW_HTTP_ENV}=true (storage option allow_http=True) if "
            "that is what you want"
        )
    return replace(options, endpoint=endpoint, allow_http=options.allow_http or allow)


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with ``endpoint`` as a URL, or None. Without a scheme, obstore's
    HTTP client fails with "builder error" (or panics), which names nothing to fix."""
    try:
        parts = urlsplit(endpoint)
        if parts.scheme.lower() in ("http", "https") and parts.hostname:
            parts.port  # noqa: B018  (raises ValueError for a port out of range)
            return None
    except ValueError as e:  # a malformed IPv6 address, a port out of range...
        if "port" in str(e).lower():
            return "has no valid port: give one from 1 to 65535, or none"
    host = endpoint.split("://")[-1].strip("/") or "HOST:PORT"
    return (
        f"is not an http:// or https:// URL: write it as https://{host} "
        f"(or http://{host} for a server on this machine)"
    )


def path_style_by_default(endpoint: str | None) -> bool:
    """Path-style addressing for an endpoint given as an IP address or ``localhost``, as
    boto3 does: no DNS name exists there to put the bucket in."""
    host = urlsplit(endpoint).hostname if endpoint else None
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def addressing(options: S3Options) -> str:
    if options.uses_path_style:
        return "path"
    return "virtual" if options.path_style is False else "auto"


def _plain_remote(endpoint: str) -> bool:
    """Whether ``endpoint`` is ``http://`` to a host other than this machine's loopback."""
    parts = urlsplit(endpoint)
    if parts.scheme.lower() != "http":
        return False
    host = (parts.hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return True
