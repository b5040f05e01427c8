"""Inputs unbroken cannot use are refused up front, by name, with what to do: tensors
without a dense layout, outputs into folders that do not exist; and the ``unbroken``
command reaches an S3 endpoint named by the environment, plain HTTP included where
that is allowed."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken import CheckpointError
from unbroken.cli.main import main as cli
from unbroken.storage import open_storage
from unbroken.storage.s3 import S3Storage

pytestmark = pytest.mark.timeout(120)

MKLDNN = torch._mkldnn  # type: ignore[attr-defined]
LAYOUTS = [
    pytest.param(lambda: torch.eye(4).to_sparse(), torch.sparse_coo, id="coo"),
    pytest.param(lambda: torch.eye(4).to_sparse_csr(), torch.sparse_csr, id="csr"),
    pytest.param(lambda: torch.eye(4).to_sparse_csc(), torch.sparse_csc, id="csc"),
    pytest.param(lambda: torch.eye(4).to_sparse_bsr((2, 2)), torch.sparse_bsr, id="bsr"),
    pytest.param(lambda: torch.eye(4).to_sparse_bsc((2, 2)), torch.sparse_bsc, id="bsc"),
    pytest.param(lambda: torch.ones(4).to_mkldnn(), MKLDNN, id="mkldnn"),
]


@pytest.mark.parametrize(("make", "layout"), LAYOUTS)
def test_a_tensor_without_a_dense_layout_is_refused_by_name(
    tmp_path: Path, make: Callable[[], torch.Tensor], layout: torch.layout
) -> None:
    if layout == MKLDNN and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no MKL-DNN")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        tensor = make()
    ckpt = unbroken.Checkpointer(tmp_path / "ckpt")
    state = {"model": torch.nn.Linear(2, 2), "embedding": {"table": tensor}}
    with pytest.raises(CheckpointError) as caught:
        ckpt.save(1, state)
    message = str(caught.value)
    assert message.startswith(f"embedding/table is a tensor of layout {layout} ")
    assert "return .to_dense() from state_dict()" in message
    assert ckpt.steps() == []


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_a_nested_tensor_is_refused_by_name(tmp_path: Path, layout: torch.layout) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype"
        tensor = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    ckpt = unbroken.Checkpointer(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"^batch is a nested tensor.*\.unbind\(\)"):
        ckpt.save(1, {"batch": tensor})
    assert ckpt.steps() == []


def test_export_into_a_missing_folder_is_a_usage_error_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    with unbroken.Checkpointer(ckpt) as c:
        c.save(1, {"model": torch.nn.Linear(2, 2)})
    out = tmp_path / "nodir" / "m.safetensors"
    assert cli(["export", str(ckpt), str(out)]) == 2  # 2: usage or input error, not damage
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: cannot write {out}: the folder {out.parent} does not exist; create it first"
    ]
    assert not out.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_run_refuses_a_timeline_json_it_could_not_write_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("open('trained', 'w').close()\n")
    argv = ["run", "--standalone", "--nproc-per-node=1"]
    assert cli([*argv, "--timeline-json", "nodir/tl.json", "train.py"]) == 2
    err = capsys.readouterr().err
    folder = tmp_path / "nodir"
    assert err.splitlines() == [
        f"unbroken run: error: --timeline-json nodir/tl.json: the folder {folder} does not "
        "exist; create it first"
    ]
    assert not Path("trained").exists()  # refused before training started
    Path("out").mkdir()
    assert cli([*argv, "--timeline-json", "out", "train.py"]) == 2
    assert "out is a directory" in capsys.readouterr().err
    Path("link.json").symlink_to(tmp_path / "elsewhere.json")
    assert cli([*argv, "--timeline-json", "link.json", "train.py"]) == 2
    assert "link.json is a symbolic link" in capsys.readouterr().err
    assert not Path("trained").exists()


@pytest.fixture
def env_s3(bucket: tuple[str, dict], monkeypatch: pytest.MonkeyPatch) -> str:
    """A bucket holding a checkpoint, and the environment a shell user sets to reach it
    (credentials and region; no endpoint yet)."""
    uri, options = bucket
    with unbroken.Checkpointer(uri, storage_options=options) as c:
        c.save(4, {"model": torch.nn.Linear(2, 2)})
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return uri


@pytest.mark.parametrize("allow", [None, "true"])
def test_the_cli_reaches_a_plain_http_endpoint_from_the_environment(
    env_s3: str,
    moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    allow: str | None,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # http://127.0.0.1:PORT
    if allow is not None:
        monkeypatch.setenv("AWS_ALLOW_HTTP", allow)
    assert cli(["verify", env_s3]) == 0, capsys.readouterr().err
    assert "OK step 4" in capsys.readouterr().out
    assert cli(["ls", env_s3]) == 0


def test_plain_http_to_another_machine_needs_aws_allow_http(
    env_s3: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = "http://192.0.2.1:9000"  # TEST-NET-1: never contacted
    monkeypatch.setenv("AWS_ENDPOINT_URL", remote)
    assert cli(["ls", env_s3]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: AWS_ENDPOINT_URL={remote} is plain HTTP to a host that is not this "
        "machine: credentials and checkpoints would cross the network unencrypted. Use "
        "https://, or set AWS_ALLOW_HTTP=true (storage option allow_http=True) if that is "
        "what you want"
    ]
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    allowed = open_storage(env_s3)
    assert isinstance(allowed, S3Storage)
    assert (allowed.options.endpoint, allowed.options.allow_http) == (remote, True)
    # An endpoint given as an option wins over the environment's.
    given = open_storage(env_s3, {"endpoint": "https://s3.example.com"})
    assert isinstance(given, S3Storage)
    assert (given.options.endpoint, given.options.allow_http) == ("https://s3.example.com", False)
