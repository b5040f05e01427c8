"""The `unbroken` command on real checkpoints."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import unbroken
from unbroken.cli import main
from unbroken.format import step_dir


@pytest.fixture
def run_dir(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(net.parameters())
    net(torch.randn(3, 4)).sum().backward()
    optim.step()
    ckpt = unbroken.Checkpointer(tmp_path / "run")
    state = {"model": net, "optim": optim, "progress": unbroken.Progress(step=5, epoch=1)}
    ckpt.save(5, state)
    ckpt.save(10, state)
    return tmp_path / "run", net


def test_ls_lists_committed_steps_only(run_dir, capsys):
    path, _ = run_dir
    (path / step_dir(15)).mkdir()  # uncommitted: never listed
    assert main(["ls", str(path)]) == 0
    out = capsys.readouterr().out
    steps = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert steps == ["5", "10"]


def test_show_lists_tensors_and_values(run_dir, capsys):
    path, _ = run_dir
    assert main(["show", str(path), "--step", "5"]) == 0
    out = capsys.readouterr().out
    assert "step 5:" in out and "model/0.weight" in out and "(8, 4)" in out
    assert "optim/state/0/exp_avg" in out and "{'step': 5, 'epoch': 1}" in out


def test_verify_passes_then_names_the_damage(run_dir, capsys):
    path, _ = run_dir
    assert main(["verify", str(path), "--all"]) == 0
    assert capsys.readouterr().out.count("OK") == 2
    manifest = unbroken.Checkpointer(path).manifest(10)
    chunk = manifest.tensors["model/1.weight"].chunks[0]
    shard = path / step_dir(10) / chunk.file
    data = bytearray(shard.read_bytes())
    data[chunk.start] ^= 1
    shard.write_bytes(data)
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED step 10" in out and chunk.file in out and "'model/1.weight'" in out
    assert main(["verify", str(path), "--step", "5"]) == 0


def test_export_writes_consolidated_weights_without_optimizer_state(run_dir, tmp_path):
    path, net = run_dir
    out = tmp_path / "model.safetensors"
    assert main(["export", str(path), str(out), "--dtype", "bfloat16"]) == 0
    weights = load_file(out)
    assert sorted(weights) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert weights["0.weight"].dtype is torch.bfloat16
    assert torch.equal(weights["0.weight"], net[0].weight.detach().to(torch.bfloat16))
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh.load_state_dict({k: v.float() for k, v in weights.items()})  # loads as-is


def test_errors_are_clear_and_exit_non_zero(run_dir, tmp_path, capsys):
    path, _ = run_dir
    assert main(["ls", str(tmp_path / "missing")]) == 2
    assert main(["show", str(path), "--step", "7"]) == 2
    assert "no committed checkpoint for step 7; committed steps: 5, 10" in capsys.readouterr().err
    assert main(["export", str(path), str(tmp_path / "x.safetensors"), "--only", "net"]) == 2
    assert "no tensors under ['net']" in capsys.readouterr().err


def test_the_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "unbroken", "--help"], capture_output=True, text=True, check=True
    )
    assert all(cmd in result.stdout for cmd in ("ls", "show", "verify", "export", "demo"))
