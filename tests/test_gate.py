"""The coordinator's gate: only the holders of the job's secret reach its store (real
TCPStore clients and servers on loopback; tests/test_multinode.py runs whole jobs through
the gate)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from unbroken.run import listen
from unbroken.run.gate import SECRET_ENV, Gate, GateError, Relay, job_secret


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2)
    )


@pytest.mark.timeout(60)
def test_only_holders_of_the_secret_reach_the_store():
    store = listen.store()
    store.set("generation", "7")
    secret = secrets.token_bytes(32)
    gate = Gate("127.0.0.1", 0, store.port, secret)
    ours = client(Relay("127.0.0.1", gate.port, secret).port)
    assert ours.get("generation") == b"7"
    ours.set("from-a-node", "1")
    assert store.get("from-a-node") == b"1"

    # A plain store client at the gate, and a relay with another secret: neither can
    # read the job's keys nor write any.
    with pytest.raises(Exception):  # noqa: B017 - torch raises DistNetworkError or ValueError
        client(gate.port).set("generation", "666")
    stranger = Relay("127.0.0.1", gate.port, secrets.token_bytes(32))
    with pytest.raises(Exception):  # noqa: B017
        client(stranger.port).set("generation", "666")
    assert stranger.failure is not None and "secret" in stranger.failure
    assert store.get("generation") == b"7" and store.num_keys() == 2
    assert gate.refused >= 2


@pytest.mark.timeout(30)
def test_a_relay_refuses_a_gate_that_does_not_prove_the_secret():
    """A relay pointed at an impostor (some other server) hands it no traffic."""
    store = listen.store()  # not a gate: answers the relay's hello with nonsense
    relay = Relay("127.0.0.1", store.port, secrets.token_bytes(32))
    with pytest.raises(Exception):  # noqa: B017
        client(relay.port).set("k", "v")
    assert relay.failure is not None and store.num_keys() == 0


def test_the_secret_is_long_enough_and_readable_by_its_owner_only(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    path.chmod(0o644)
    with pytest.raises(GateError, match=r"readable by others.*chmod 600"):
        job_secret(str(path))
    path.chmod(0o600)
    assert job_secret(str(path)) == b"0123456789abcdef0123456789abcdef"
    assert job_secret(None) is None
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(GateError, match="openssl rand -hex 32"):
        job_secret(str(path))


@pytest.mark.timeout(60)
def test_the_coordinator_listens_beyond_loopback_only_with_a_secret_or_insecure():
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    cmd = [sys.executable, "-m", "unbroken", "coordinator", "--host=0.0.0.0", "--port=0"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert refused.returncode == 2 and SECRET_ENV in refused.stderr, refused.stderr
    secret = secrets.token_hex(32)
    for extra, env2 in (["--insecure"], env), ([], {**env, SECRET_ENV: secret}):
        proc = subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, text=True, env=env2)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert "listening on 0.0.0.0:" in line and secret not in line, line
        finally:
            proc.kill()
            proc.wait()
