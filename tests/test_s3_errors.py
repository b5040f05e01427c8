"""What the S3 backend says when it cannot go on, on a real S3 server (moto's, on loopback):
missing credentials, a missing bucket, a server that keeps failing, an endpoint nothing
listens on; and the addressing style an endpoint gets without `path_style`."""

import os
import re
import socket
import time

import pytest
import torch

from conftest import s3_client
from ranks import free_port
from servers.faulty_proxy import FaultyProxy
from unbroken import Checkpointer, CheckpointError
from unbroken.storage import open_storage
from unbroken.storage.s3 import S3Options


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """An environment with no AWS variable and an empty home: nothing real is found."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no 1 s wait on a laptop
    return tmp_path


def test_missing_credentials_say_where_they_were_looked_for(no_aws):
    with pytest.raises(CheckpointError) as failure:
        Checkpointer("s3://my-bucket/x")
    message = str(failure.value)
    assert message.startswith("s3://my-bucket/x: no AWS credentials found for bucket 'my-bucket'")
    for source in (
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        "profile [default] of ~/.aws/credentials (AWS_PROFILE)",
        "~/.aws/config",
        "SSO",
        "container role",
        "instance role",
    ):
        assert source in message
    assert 'storage_options={"access_key_id": ..., "secret_access_key": ...}' in message


def test_a_missing_profile_is_named(no_aws, monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "training")
    with pytest.raises(CheckpointError, match=r"my-bucket.*\(training\) could not be found in"):
        Checkpointer("s3://my-bucket/x")


def test_credentials_from_the_shared_file_reach_the_bucket(no_aws, bucket):
    (no_aws / ".aws").mkdir()
    (no_aws / ".aws/credentials").write_text(
        "[default]\naws_access_key_id = test\naws_secret_access_key = test\n"
    )
    uri, options = bucket
    options = {k: v for k, v in options.items() if "access_key" not in k}
    Checkpointer(uri, storage_options=options).save(1, {"w": torch.ones(3)})
    restored = {"w": torch.zeros(3)}
    assert Checkpointer(uri, storage_options=options).restore(restored) == 1
    assert torch.equal(restored["w"], torch.ones(3))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_an_ip_or_localhost_endpoint_is_path_style_by_itself(bucket, host):
    uri, options = bucket
    options = {k: v for k, v in options.items() if k != "path_style"}
    options["endpoint"] = options["endpoint"].replace("127.0.0.1", host)
    ckpt = Checkpointer(uri, storage_options=options)
    ckpt.save(1, {"w": torch.ones(3)})
    assert ckpt.steps() == [1]
    bucket_name = uri.removeprefix("s3://").split("/")[0]
    listed = s3_client(options["endpoint"]).list_objects_v2(Bucket=bucket_name)
    assert "runs/exp/step-000000001/manifest.json" in [o["Key"] for o in listed["Contents"]]


@pytest.mark.parametrize(
    ("path_style", "endpoint", "expected"),
    [
        (None, "http://127.0.0.1:9000", True),
        (None, "http://[::1]:9000", True),
        (None, "http://localhost:9000", True),
        (None, "https://rgw:7480", False),  # a host name: virtual-hosted, as boto3 does
        (None, None, False),  # AWS
        (True, "https://rgw:7480", True),
        (False, "http://localhost:9000", False),
    ],
)
def test_addressing_style(path_style, endpoint, expected):
    assert S3Options(path_style=path_style, endpoint=endpoint).uses_path_style is expected


def test_virtual_hosted_addressing_cannot_use_an_ip_endpoint():
    with pytest.raises(ValueError, match=r"path_style=False .* http://127.0.0.1:9000 is an IP"):
        Checkpointer("s3://b/x", storage_options={"endpoint": "http://127.0.0.1:9000",
                                                  "path_style": False})  # fmt: skip


def test_a_missing_bucket_is_named_with_the_object_and_the_operation(bucket):
    _, options = bucket
    ckpt = Checkpointer("s3://no-such-bucket/runs/exp", storage_options=options)
    with pytest.raises(CheckpointError) as failure:
        ckpt.save(1, {"w": torch.ones(3)})
    message = str(failure.value)
    assert re.match(r"(LIST|PUT) s3://no-such-bucket/runs/exp/", message)
    assert "404 Not Found: NoSuchBucket" in message
    assert f"the endpoint {options['endpoint']} has no bucket 'no-such-bucket'" in message
    assert type(failure.value.__cause__).__module__.startswith(("obstore", "builtins"))


def test_a_lasting_server_error_names_the_ranged_get(bucket, moto_endpoint):
    uri, options = bucket
    Checkpointer(uri, storage_options=options).save(1, {"w": torch.ones(1000)})
    proxy = FaultyProxy(moto_endpoint)
    endpoint = proxy.start()
    try:
        proxy.inject("503", lambda method, path: method == "GET" and ".safetensors" in path, 99)
        fast = options | {"endpoint": endpoint, "retry_timeout": 2.0, "max_retries": 2}
        with pytest.raises(CheckpointError) as failure:
            Checkpointer(uri, storage_options=fast).restore({"w": torch.zeros(1000)})
    finally:
        proxy.stop()
    assert re.search(
        rf"GET {uri}/step-000000001/\S+ \(bytes \d+-\d+\): 503 Service Unavailable: "
        r"SlowDown: Please reduce your request rate\.",
        str(failure.value),
    ), failure.value
    assert failure.value.__cause__ is not None


@pytest.mark.parametrize("operation", ["save", "restore"])
def test_an_unreachable_endpoint_is_named_with_how_long_it_was_tried(bucket, operation):
    uri, options = bucket
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    options = options | {"endpoint": endpoint, "retry_timeout": 1.0, "max_retries": 3}
    ckpt = Checkpointer(uri, storage_options=options)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as failure:
        if operation == "save":
            ckpt.save(1, {"w": torch.ones(3)})
        else:
            ckpt.restore({"w": torch.ones(3)})
    assert time.monotonic() - start < 10
    assert re.search(
        rf"{uri}/\S*: cannot reach the S3 endpoint {endpoint} \(tcp connect error: "
        r"Connection refused\); gave up after \d+\.\d s \(timeout=60 s a request, "
        r"retry_timeout=1 s, max_retries=3\)",
        str(failure.value),
    ), failure.value


def test_a_server_that_never_replies_is_named_with_how_long_it_was_waited_for(bucket):
    uri, options = bucket
    with socket.socket() as silent:  # accepts connections (the kernel does), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        options = options | {"endpoint": endpoint, "timeout": 0.5, "retry_timeout": 1.0}
        start = time.monotonic()
        with pytest.raises(CheckpointError) as failure:
            Checkpointer(uri, storage_options=options).restore({"w": torch.ones(3)})
    assert time.monotonic() - start < 10
    assert re.search(
        rf"GET {uri}/latest: cannot reach the S3 endpoint {endpoint} \(no reply within the "
        r"request timeout\); gave up after \d+\.\d s \(timeout=0.5 s a request",
        str(failure.value),
    ), failure.value


def test_a_host_name_endpoint_without_per_bucket_dns_says_to_use_path_style(bucket):
    uri, options = bucket
    options = {k: v for k, v in options.items() if k != "path_style"}
    options |= {
        "endpoint": "http://rgw.invalid:7480",
        "allow_http": True,
        "retry_timeout": 1.0,
        "max_retries": 1,
    }
    bucket_name = uri.removeprefix("s3://").split("/")[0]
    with pytest.raises(CheckpointError) as failure:
        Checkpointer(uri, storage_options=options).restore({"w": torch.ones(3)})
    message = str(failure.value)
    assert (
        f"cannot reach the S3 endpoint http://{bucket_name}.rgw.invalid:7480 (dns error" in message
    )
    assert 'pass "path_style": True' in message


def test_a_boto3_error_is_named_with_the_prefix_and_the_operation(bucket, caplog):
    _, options = bucket
    storage = open_storage("s3://no-such-bucket/x", options)
    with pytest.raises(CheckpointError, match=r"^PUT s3://no-such-bucket/x/f \(1 bytes\): 404"):
        storage.write("f", [b"1"])  # fails, then aborts its uploads through boto3
    assert (
        "could not abort uploads: LIST and ABORT multipart uploads under s3://no-such-bucket/x/f: "
        "404 NoSuchBucket: The specified bucket does not exist (the endpoint "
        f"{options['endpoint']} has no bucket 'no-such-bucket'"
    ) in caplog.text
