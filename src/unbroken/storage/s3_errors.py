"""What the S3 backend says when it cannot go on: missing credentials, an endpoint it
cannot reach, and any other error of obstore or boto3, each turned into a
`CheckpointError` that names the bucket or object, the operation, and what to do.

obstore's errors carry the whole request in a Rust debug dump; `describe` keeps what a
user acts on (the HTTP status and the server's error code, or why no connection opened).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit

from unbroken.errors import CheckpointError


class EndpointUnreachable(CheckpointError):
    """No connection to the endpoint opened, or no reply came, until retries ran out."""


_URL = re.compile(r"Error performing [A-Z]+ (\S+)")
_STATUS = re.compile(r"status code: (\d{3}[^:]*): ?(.*)", re.DOTALL)
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_CONNECT = re.compile(r'ConnectError\(\s*"([^"]+)"')
_DETAIL = re.compile(r'(?:message|error): "([^"]+)"')
_PASS_KEYS = (
    'storage_options={"access_key_id": ..., "secret_access_key": ...} (with "session_token" '
    "for temporary credentials), or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the "
    "environment of every rank, or AWS_PROFILE to a profile of the shared files"
)


def boto3_credentials(uri: str, bucket: str) -> Any:
    """A credential provider over boto3's chain, or a `CheckpointError` that says where
    the chain looked (None without boto3: obstore's own environment lookup applies)."""
    try:
        import boto3
        import botocore.exceptions
        import botocore.session
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    try:
        core = botocore.session.get_session()
        session = boto3.Session(botocore_session=core)
        found = session.get_credentials()
    except botocore.exceptions.BotoCoreError as e:  # a profile that does not exist...
        credentials, config, _ = _shared_files()
        raise CheckpointError(
            f"{uri}: no AWS credentials for bucket {bucket!r}: {e} in {credentials} or "
            f"{config} (set by AWS_PROFILE). Pass them with {_PASS_KEYS}."
        ) from e
    if found is None:
        resolver = core.get_component("credential_provider")
        tried = [_source(p.METHOD) for p in resolver.providers]
        raise CheckpointError(
            f"{uri}: no AWS credentials found for bucket {bucket!r}. Looked in, in order: "
            + "; ".join(tried)
            + f". Pass them with {_PASS_KEYS}."
        )
    return Boto3CredentialProvider(session)


def _source(method: str) -> str:
    """Where boto3's credential provider ``method`` looks, in words."""
    credentials, config, profile = _shared_files()
    return {
        "env": "environment variables AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        "assume-role": f"a role_arn in profile [{profile}] of {config} (AWS_PROFILE)",
        "assume-role-with-web-identity": "AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN",
        "sso": f"SSO for profile [{profile}] (`aws sso login`)",
        "shared-credentials-file": f"profile [{profile}] of {credentials} (AWS_PROFILE)",
        "login": f"`aws login` for profile [{profile}]",
        "custom-process": f"a credential_process in profile [{profile}] of {config}",
        "config-file": f"keys in profile [{profile}] of {config}",
        "ec2-credentials-file": "the file named by AWS_CREDENTIAL_FILE",
        "boto-config": "boto2's /etc/boto.cfg and ~/.boto",
        "container-role": "a container role (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or "
        "_FULL_URI, as on ECS)",
        "iam-role": "an instance role from the EC2 instance metadata service",
    }.get(method, method)


def _shared_files() -> tuple[str, str, str]:
    """The shared credentials and config files boto3 reads, and the profile it picks."""
    credentials = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    config = os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    return credentials, config, profile


def no_such_bucket(error: BaseException) -> bool:
    response = getattr(error, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        return bool(response.get("Error", {}).get("Code") == "NoSuchBucket")
    return "<Code>NoSuchBucket</Code>" in str(error)


def s3_error(
    what: str, error: BaseException, elapsed: float, options: Any, bucket: str
) -> CheckpointError:
    """``what`` (operation and object, e.g. "GET s3://b/p/f (bytes 0-99)") failed with
    ``error`` after ``elapsed`` seconds: the error to raise, naming what to do."""
    reason, unreachable, url = describe(error)
    host = urlsplit(url).hostname if url else None
    endpoint = _origin(url) or options.endpoint or "AWS S3"
    if unreachable:
        hint = "check the endpoint's address and that the server runs"
        if host and host.startswith(f"{bucket}."):
            hint = (
                f"virtual-hosted addressing puts the bucket in the host name ({host}); for a "
                'server without per-bucket DNS (MinIO, Ceph RGW...) pass "path_style": True'
            )
        return EndpointUnreachable(
            f"{what}: cannot reach the S3 endpoint {endpoint} ({reason}); gave up after "
            f"{elapsed:.1f} s (timeout={options.timeout:g} s a request, retry_timeout="
            f"{options.retry_timeout:g} s, max_retries={options.max_retries}): {hint}"
        )
    if "builder error" in reason:  # obstore could not make a request URL of the endpoint
        reason += (
            f" (no valid request URL comes of the endpoint {endpoint} and bucket {bucket!r}: "
            "give the endpoint as http(s)://HOST[:PORT], as the storage option endpoint, "
            "AWS_ENDPOINT_URL or unbroken's --endpoint)"
        )
    if no_such_bucket(error):
        reason += f" (the endpoint {endpoint} has no bucket {bucket!r}: create it, or fix the URI)"
    took = f" (after {elapsed:.1f} s)" if elapsed >= 0.1 else ""
    return CheckpointError(f"{what}: {reason}{took}")


def describe(error: BaseException) -> tuple[str, bool, str | None]:
    """(what went wrong in a few words, whether no connection or reply came, the URL)."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        detail = response.get("Error", {})
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
        return f"{status} {detail.get('Code', '')}: {detail.get('Message', '')}", False, None
    text = str(error)
    head, _, debug = text.partition("Debug source:")
    url = m.group(1) if (m := _URL.search(head)) else None
    if m := _STATUS.search(head):
        status, body = m.groups()
        code, message = _tag("Code", body), _tag("Message", body)
        said = ": ".join(x for x in (code, message) if x) or body.strip()[:200]
        return (f"{status}: {said}" if said else status), False, url
    kind = m.group(1) if (m := _HTTP_KIND.search(debug)) else None
    if kind in ("Connect", "Timeout"):
        details = _DETAIL.findall(debug)
        connect = m.group(1) if (m := _CONNECT.search(debug)) else "no reply in time"
        if kind == "Timeout":
            return "no reply within the request timeout", True, url
        return ": ".join([connect, *details[-1:]]), True, url
    if "Could not connect to the endpoint URL" in text:  # botocore's EndpointConnectionError
        return text, True, None
    return head.rsplit("  - ", 1)[-1].strip() or type(error).__name__, False, url


def _tag(name: str, xml: str) -> str:
    m = re.search(f"<{name}>(.*?)</{name}>", xml, re.DOTALL)
    return m.group(1).strip() if m else ""


def _origin(url: str | None) -> str | None:
    if not url:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
