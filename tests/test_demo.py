"""The `unbroken demo`: its model and data pieces, and the full kill-and-resume run."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from unbroken.cli.main import main as cli
from unbroken.data import ByteTokenizer, TokenDataset
from unbroken.demo import report, run
from unbroken.demo.model import GPTConfig, TinyGPT, load_corpus, tokenise_corpus
from unbroken.run.procs import alive


def test_corpus_ships_with_the_package_and_tokenises_to_bytes(tmp_path: Path) -> None:
    text = load_corpus()
    assert 5_000 < len(text.encode()) < 200_000
    path = tokenise_corpus(tmp_path / "corpus.tokens")
    dataset = TokenDataset(path, seq_len=GPTConfig(vocab_size=257).block_size)
    assert dataset.tokens == len(text.encode()) + 1  # the bytes, then end of document
    assert ByteTokenizer().decode(torch.cat([dataset[i][:-1] for i in range(3)])) == text[:192]


def test_tiny_gpt_starts_near_uniform_and_dropout_draws_from_the_global_rng() -> None:
    vocab_size = 50
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=vocab_size, block_size=16))
    x = torch.randint(vocab_size, (4, 16))
    y = torch.randint(vocab_size, (4, 16))
    loss = model(x, y)
    assert abs(loss.item() - math.log(vocab_size)) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())

    rng = torch.get_rng_state()
    first = model(x, y)
    torch.set_rng_state(rng)
    assert torch.equal(model(x, y), first)  # same RNG state: same dropout masks
    assert not torch.equal(model(x, y), first)  # RNG moved on: different masks
    model.eval()
    assert torch.equal(model(x, y), model(x, y))


def _launch(losses: dict[int, float], restored: int | None = None) -> report.Launch:
    return report.Launch(losses=dict(losses), restored=restored)


def test_comparison_is_bitwise_and_covers_the_recomputed_steps() -> None:
    ref = {s: 1.0 + s / 7 for s in range(1, 11)}
    killed = _launch({s: v for s, v in ref.items() if s <= 7})
    resumed = _launch({s: v for s, v in ref.items() if s > 5}, restored=5)
    assert report.mismatches(10, _launch(ref), killed, resumed) == []
    assert report.combined_curve(killed, resumed) == ref

    off_by_one_ulp = dict(resumed.losses)
    off_by_one_ulp[9] = math.nextafter(ref[9], math.inf)
    assert report.mismatches(10, _launch(ref), killed, _launch(off_by_one_ulp, 5)) == [9]

    # A lost step the killed launch printed must match too, although the table shows the
    # recomputed value for it.
    bad_lost = _launch(killed.losses)
    bad_lost.losses[6] = ref[6] + 1e-9
    assert report.mismatches(10, _launch(ref), bad_lost, resumed) == [6]
    # A resumed run that stops early leaves steps missing: that is a mismatch as well.
    short = _launch({s: v for s, v in resumed.losses.items() if s < 10}, restored=5)
    assert report.mismatches(10, _launch(ref), killed, short) == [10]


def test_long_runs_show_a_sample_of_rows_but_every_interesting_one() -> None:
    rows = report._rows_to_show(1000, 50, restored=300, killed_at=333, bad=[777])
    assert len(rows) < 120
    assert {1, 50, 299, 300, 317, 333, 334, 777, 1000} <= set(rows)
    assert report._rows_to_show(60, 10, 30, 35, []) == list(range(1, 61))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def testkill_tree_reaches_workers_in_their_own_sessions(tmp_path: Path) -> None:
    # Like torchrun: a parent whose child runs in a new session (so not in its group).
    pidfile = tmp_path / "child.pid"
    child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    worker = int(pidfile.read_text())
    assert os.getpgid(worker) != os.getpgid(parent.pid)

    run.kill_tree(parent.pid)
    assert parent.wait(timeout=10) == -9
    deadline = time.monotonic() + 10
    while alive(worker):
        assert time.monotonic() < deadline, "the worker survived the kill"
        time.sleep(0.05)


def test_plot_without_matplotlib_fails_fast_with_a_hint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("matplotlib is installed")
    assert run.main(["--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'unbroken[plot]'" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_demo_kills_resumes_and_matches_bit_for_bit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run, "LAUNCH_TIMEOUT_S", 60.0)  # fail well inside the test timeout
    argv = ["--steps", "30", "--kill-at", "17", "--save-every", "5", "--dir", str(tmp_path)]
    code = run.main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"Verdict: {report.VERDICT_EQUAL}" in out
    assert "all 30 losses are bitwise identical" in out

    killed = re.search(r"run to be killed .*SIGKILL after step (\d+)", out)
    resumed = re.search(r"resumed run .* from step (\d+)\s+-> step 30 ", out)
    assert killed and resumed, out
    kill_step, restored = int(killed.group(1)), int(resumed.group(1))
    # The kill landed past --kill-at, and the restore used a checkpoint from before it.
    assert kill_step >= 17
    assert 0 < restored <= kill_step and restored % 5 == 0
    # Both runs wrote their checkpoints where they were told to, and they are kept, with
    # the timeline and the commands to try on them.
    assert any((tmp_path / "uninterrupted").iterdir())
    assert any((tmp_path / "killed").iterdir())
    assert f"unbroken verify {tmp_path}/killed --all" in out
    timeline = json.loads((tmp_path / run.TIMELINE).read_text())
    assert timeline["verdict"] == report.VERDICT_EQUAL and timeline["mismatched_steps"] == []
    assert timeline["launches"]["killed"]["killed"] is True
    assert timeline["launches"]["resumed"]["restored"] == restored
    assert (
        timeline["launches"]["resumed"]["losses"]["30"]
        == timeline["launches"]["uninterrupted"]["losses"]["30"]
    )
    # Every command the demo suggests runs as printed, on what it kept.
    hints = [shlex.split(line) for line in out.split("Try:", 1)[1].splitlines() if line[:2] == "  "]
    assert [h[1] for h in hints] == ["ls", "verify", "show", "export", "goodput"], hints
    for argv in hints:
        assert cli(argv[1:]) == 0, argv
    capsys.readouterr()
    # ls on the folder finds both runs' checkpoints in its subfolders, verify passes.
    assert cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 of its subfolders do" in out and f"{tmp_path}/killed" in out
    assert cli(["verify", str(tmp_path / "killed"), "--all", "--quiet"]) == 0
    assert capsys.readouterr().out.count("OK step") == 30 // 5


def test_clean_deletes_only_what_the_demo_wrote(tmp_path: Path) -> None:
    console = Console(file=io.StringIO())
    mine = tmp_path / "mine.txt"
    mine.write_text("not the demo's")
    for name in ("uninterrupted", "killed"):
        (tmp_path / name / "step-000000005").mkdir(parents=True)
    (tmp_path / run.TIMELINE).write_text("{}")
    run._keep_or_clean(console, tmp_path, created=False, clean=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]

    fresh = tmp_path / "fresh"
    (fresh / "killed").mkdir(parents=True)
    run._keep_or_clean(console, fresh, created=True, clean=True)
    assert not fresh.exists()


def test_demo_keeps_its_files_in_the_current_directory_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    default = run.default_dir()
    assert not default.is_absolute() and default.name.startswith("unbroken-demo-")
    args = run.parse_args([])
    assert args.dir is None and not args.clean
