"""The `unbroken` command on real checkpoints."""

import importlib.util
import json
import os
import pty
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import unbroken
from unbroken.cli.main import main
from unbroken.format.layout import step_dir
from unbroken.run.args import script_problem


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


def test_ls_on_a_folder_of_runs_lists_the_subfolders_checkpoints(run_dir, capsys):
    path, _ = run_dir  # tmp_path/run; tmp_path itself holds no checkpoint
    parent = path.parent
    (parent / "empty").mkdir()
    (parent / "notes.txt").write_text("not a run")
    assert main(["ls", str(parent)]) == 0
    out = capsys.readouterr().out
    assert f"{parent} holds no checkpoints itself; 1 of its subfolders do" in out
    assert str(path) in out and f"unbroken ls {path}" in out
    assert str(parent / "empty") not in out
    assert main(["ls", str(parent / "empty")]) == 0
    assert "no committed checkpoints, nor in its subfolders" in capsys.readouterr().out


def test_json_output_of_ls_show_and_verify(run_dir, capsys):
    path, _ = run_dir
    assert main(["ls", str(path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in listing["checkpoints"]] == [5, 10]
    assert set(listing["checkpoints"][0]) == {"step", "nbytes", "tensors", "ranks", "created"}
    assert listing["subfolders"] == []
    assert main(["ls", str(path.parent), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["checkpoints"] == [] and listing["subfolders"][0]["path"] == str(path)

    assert main(["show", str(path), "--json", "--step", "5"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == 5 and shown["ranks"] == 1 and shown["state_versions"] == 1
    weight = next(t for t in shown["tensor_list"] if t["name"] == "model/0.weight")
    assert weight == {"name": "model/0.weight", "dtype": "F32", "shape": [8, 4],
                      "blocks": 1, "nbytes": 128}  # fmt: skip
    assert shown["state"]["progress"] == {"step": 5, "epoch": 1}

    chunk = _flip_a_bit(path, 10, "model/1.weight")
    assert main(["verify", str(path), "--all", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and [s["ok"] for s in report["steps"]] == [True, False]
    assert report["steps"][1]["damage"] == [
        {"file": chunk.file, "tensor": "model/1.weight", "problem": "checksum mismatch"}
    ]


def _flip_a_bit(path, step, key):
    chunk = unbroken.Checkpointer(path).manifest(step).tensors[key].chunks[0]
    shard = path / step_dir(step) / chunk.file
    data = bytearray(shard.read_bytes())
    data[chunk.start] ^= 1
    shard.write_bytes(data)
    return chunk


def test_export_refuses_an_existing_file_unless_forced(run_dir, tmp_path, capsys):
    path, _ = run_dir
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"someone's weights")
    assert main(["export", str(path), str(out)]) == 2
    assert f"{out} already exists; pass --force to overwrite it" in capsys.readouterr().err
    assert out.read_bytes() == b"someone's weights"
    assert main(["export", str(path), str(out), "--force"]) == 0
    assert sorted(load_file(out)) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert not (tmp_path / "model.safetensors.partial").exists()


def _on_a_terminal(argv):
    """Run `python -m unbroken ARGV` with stdout and stderr on a pseudo-terminal."""
    leader, follower = pty.openpty()
    env = dict(os.environ, TERM="xterm", COLUMNS="120")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", *argv], stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_progress_bar_on_a_terminal_only_and_not_with_quiet(run_dir, tmp_path):
    path, _ = run_dir
    assert "reading step 10" in _on_a_terminal(["verify", str(path)])
    assert "reading step 10" not in _on_a_terminal(["verify", str(path), "--quiet"])
    piped = subprocess.run(
        [sys.executable, "-m", "unbroken", "export", str(path), str(tmp_path / "m.st")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "reading step" not in piped.stdout + piped.stderr and "wrote 4 tensors" in piped.stdout


def test_exit_codes_are_documented_and_usage_errors_return_2(capsys):
    with pytest.raises(SystemExit):
        _parser_help()
    helptext = capsys.readouterr().out
    assert "0  ok" in helptext and "1  damage found" in helptext and "2  usage" in helptext
    assert main(["verify"]) == 2  # PATH missing: argparse's usage error
    assert main(["frobnicate"]) == 2
    assert main(["--help"]) == 0


def _parser_help():
    from unbroken.cli.main import _parser

    _parser().parse_args(["--help"])


def test_run_refuses_a_missing_script_before_starting_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    assert main(["run", "--nproc-per-node=2", "missing.py", "--lr", "3"]) == 2
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"unbroken run: error: missing.py: no such file (relative to {tmp_path}); "
        "check the script's path"
    ]
    assert "ChildFailedError" not in err and "torchrun" not in err
    assert elapsed < 1.0  # no torchrun started: a launch takes seconds
    assert main(["run", "-m", "no_such_module.train"]) == 2
    assert "-m no_such_module.train: no module of that name" in capsys.readouterr().err
    (tmp_path / "jobs").mkdir()
    assert main(["run", "jobs"]) == 2
    assert "jobs is a directory" in capsys.readouterr().err


def test_run_preflight_finds_modules_in_the_current_directory(tmp_path, monkeypatch):
    # `python -m job` in a worker finds ./job.py; the check must find it the same way,
    # although the `unbroken` console script does not have the current directory on its path.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job_here.py").write_text("")
    assert importlib.util.find_spec("job_here") is None  # not on this process's path
    assert script_problem("job_here", module=True, no_python=False) is None
    assert script_problem("job_there", module=True, no_python=False) is not None
    assert script_problem("python3", module=False, no_python=True) is None
    problem = script_problem("no-such-prog", module=False, no_python=True)
    assert problem is not None and "no such executable" in problem
