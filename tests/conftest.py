from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ranks import free_port
from servers.rgw import RGW, RGWUnavailable, start_rgw


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--trials",
        type=int,
        default=210,
        help="crash-consistency trials in all (tests/test_crash.py); more on demand",
    )


@pytest.fixture(scope="session")
def trials(request: pytest.FixtureRequest) -> int:
    """How many crash trials to run in all (``--trials N``; CI runs the default)."""
    return int(request.config.getoption("--trials"))


@pytest.fixture(autouse=True, scope="session")
def _run_dirs_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`unbroken run` keeps every launch's events under $XDG_STATE_HOME: the suite's stay
    in its own temporary folder, not the user's home."""
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 4))


def train_steps(model: nn.Module, optim: torch.optim.Optimizer, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(torch.randn(5, 8)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3 server (moto's), on loopback, for the whole session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def s3_client(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )


@pytest.fixture
def bucket(moto_endpoint: str) -> tuple[str, dict]:
    """A fresh bucket: its URI and the storage options that reach it."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_client(moto_endpoint).create_bucket(Bucket=name)
    options = {
        "endpoint": moto_endpoint,
        "region": "us-east-1",
        "path_style": True,
        "access_key_id": "test",
        "secret_access_key": "test",
        "part_size": 5 << 20,
        "retry_timeout": 10.0,
    }
    return f"s3://{name}/runs/exp", options


@pytest.fixture(scope="session")
def rgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RGW]:
    """A real Ceph RGW, started on loopback for the session (tests/servers/rgw.sh).
    Skipped, with the reason, where it cannot start; UNBROKEN_REQUIRE_RGW=1 (CI) fails."""
    try:
        server = start_rgw(tmp_path_factory.mktemp("rgw"))
    except RGWUnavailable as e:
        if os.environ.get("UNBROKEN_REQUIRE_RGW"):
            pytest.fail(f"RGW required but unavailable: {e.reason}")
        pytest.skip(f"RGW unavailable: {e.reason}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def rgw_bucket(rgw: RGW) -> tuple[str, dict]:
    """A fresh bucket on RGW: its URI and the storage options that reach it."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=rgw.endpoint,
        region_name=rgw.region,
        aws_access_key_id=rgw.access_key,
        aws_secret_access_key=rgw.secret_key,
    )
    client.create_bucket(Bucket=name)
    options = {
        "endpoint": rgw.endpoint,
        "region": rgw.region,
        "path_style": True,
        "access_key_id": rgw.access_key,
        "secret_access_key": rgw.secret_key,
        "part_size": 5 << 20,
        "retry_timeout": 10.0,
    }
    return f"s3://{name}/runs/exp", options


class BackupSpy:
    """Counts the bytes restores back up (`unbroken.restoring.pipeline.Backup`, spied on)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import unbroken.restoring.backup
        import unbroken.restoring.pipeline

        self.nbytes = 0
        spy = self

        class Counted(unbroken.restoring.backup.Backup):
            def __init__(self, regions: object) -> None:
                super().__init__(regions)  # type: ignore[arg-type]
                spy.nbytes += sum(copy.nbytes for _, copy in self._saved)

        monkeypatch.setattr(unbroken.restoring.pipeline, "Backup", Counted)


@pytest.fixture
def backups(monkeypatch: pytest.MonkeyPatch) -> BackupSpy:
    """From now on in this test, how many bytes restores back up (``backups.nbytes``)."""
    return BackupSpy(monkeypatch)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted multi-node run (tests/test_multinode.py's `Cluster`) every
    multi-node case is compared with; tests/test_etcd.py's too: where the store is does
    not change a bit of the training."""
    from test_multinode import Cluster, run_plain

    c = Cluster(tmp_path_factory.mktemp("reference"))
    try:
        run = run_plain(c)
    finally:
        c.close()
    assert len({p for p in run["params"]}) == 1  # DDP: every rank agrees
    assert {s["seen_generation"] for s in run["starts"]} == {0}
    return run
