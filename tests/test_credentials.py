"""S3 credentials stay secret (no repr, error, log line or stored file holds them), and
S3 requests use TLS unless the endpoint is this machine or plain HTTP is asked for."""

from __future__ import annotations

import logging
import traceback

import pytest
import torch

from ranks import free_port
from unbroken import Checkpointer, CheckpointError
from unbroken.storage import open_storage
from unbroken.storage.s3 import S3Options

pytestmark = pytest.mark.timeout(120)

SECRETS = {
    "access_key_id": "AKIAUNBROKENKEYID42",
    "secret_access_key": "unbroken-SECRET-value-9f3c",
    "session_token": "unbroken-SESSION-token-77ab",
}


def _texts(error: BaseException) -> list[str]:
    """Everything an error shows: its message, repr and traceback, with its causes."""
    return ["".join(traceback.format_exception(error)), repr(error), str(error)]


def _leaks(texts: list[str]) -> list[tuple[str, str]]:
    return [(name, t) for t in texts for name, secret in SECRETS.items() if secret in t]


def test_credentials_never_appear_in_reprs_errors_logs_or_the_checkpoint(bucket, caplog):
    uri, options = bucket
    options = options | SECRETS | {"retry_timeout": 1.0, "max_retries": 1}
    caplog.set_level(logging.DEBUG)
    texts = [repr(S3Options.from_dict(options)), str(S3Options.from_dict(options))]
    storage = open_storage(uri, options)
    texts.append(repr(storage))
    ckpt = Checkpointer(uri, storage_options=options)
    ckpt.save(1, {"w": torch.ones(3)})
    ckpt.wait()
    texts.append(repr(ckpt))
    stored = [storage.read(f"step-000000001/{n}") for n in storage.list("step-000000001")]
    texts += [bytes(raw).decode("latin-1") for raw in stored]
    failures: list[BaseException] = []
    wrong_bucket = "s3://unbroken-no-such-bucket-7c1/x"
    dead_endpoint = options | {"endpoint": f"http://127.0.0.1:{free_port()}"}
    for where, opts in ((wrong_bucket, options), (uri, dead_endpoint)):
        with pytest.raises(CheckpointError) as failure:
            Checkpointer(where, storage_options=opts).restore({"w": torch.zeros(3)})
        failures.append(failure.value)
    with pytest.raises(ValueError) as bad:  # a credential half given
        S3Options.from_dict({k: v for k, v in options.items() if k != "access_key_id"})
    failures.append(bad.value)
    for error in failures:
        texts += _texts(error)
    texts += [r.getMessage() for r in caplog.records] + [caplog.text]
    assert "unbroken-no-such-bucket-7c1" in "".join(_texts(failures[0]))  # real failures
    assert len(stored) >= 2 and len(caplog.records) > 0
    assert _leaks(texts) == []


@pytest.mark.parametrize(
    "endpoint", ["http://10.1.2.3:9000", "http://s3.example.com", "HTTP://192.168.0.7"]
)
def test_plain_http_to_another_machine_is_refused_unless_allowed(endpoint):
    with pytest.raises(ValueError, match=r"plain HTTP .* allow_http=True"):
        S3Options(endpoint=endpoint)
    assert S3Options(endpoint=endpoint, allow_http=True).allow_http
    with pytest.raises(ValueError, match="allow_http=True"):  # as other bad options
        Checkpointer("s3://b/p", storage_options={"endpoint": endpoint})


@pytest.mark.parametrize(
    "endpoint",
    ["https://s3.example.com", "http://127.0.0.1:9000", "http://127.8.9.10", "http://[::1]:9000",
     "http://localhost:7480"],
)  # fmt: skip
def test_tls_and_loopback_endpoints_are_allowed_by_default(endpoint):
    assert S3Options(endpoint=endpoint).endpoint == endpoint
