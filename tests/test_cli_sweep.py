"""Every `unbroken` subcommand, given bad input: missing paths, wrong types, zero and
negative numbers, empty files. None may show the user a Python traceback; each must say
what is wrong on stderr and exit with a documented code (1: damage found, 2: usage or
input error; `unbroken --help`'s "exit codes"). In-process, through `main`, except where
only a real process shows the behaviour (a closed pipe, what an import costs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.cli.main import EXIT_CODES, main
from unbroken.format.layout import step_dir

TRACEBACK = "Traceback (most recent call last)"
DOCUMENTED = {1, 2}


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with what the sweep points at: a checkpoint (steps 5 and 10, no metric),
    an empty folder, an empty file, a text file, and a checkpoint whose manifest of
    step 10 is damaged."""
    root = tmp_path_factory.mktemp("sweep")
    net = torch.nn.Linear(4, 2)
    for name in ("run", "damaged"):
        with unbroken.Checkpointer(root / name) as ckpt:
            ckpt.save(5, {"model": net})
            ckpt.save(10, {"model": net})
    (root / "damaged" / step_dir(10) / "manifest.json").write_text("{ not json")
    (root / "empty").mkdir()
    (root / "empty.txt").write_text("")
    (root / "notes.txt").write_text("no RESULT line here\n")
    return root


# Each a command line; ``{p}`` stands for the sweep's folder.
RUN, EMPTY, FILE, MISSING = "{p}/run", "{p}/empty", "{p}/empty.txt", "{p}/missing"
CASES: list[tuple[str, ...]] = [
    (),
    ("frobnicate",),
    *[(cmd, MISSING) for cmd in ("ls", "show", "verify", "gc")],
    *[(cmd, FILE) for cmd in ("ls", "show", "verify")],
    ("show", EMPTY),
    ("verify", EMPTY),
    ("show", RUN, "--step", "7"),
    ("show", RUN, "--step", "-1"),
    ("show", RUN, "--step", "abc"),
    ("verify", RUN, "--step", "0"),
    ("verify", RUN, "--step", "5", "--all"),
    ("ls", RUN, "--endpoint", "http://127.0.0.1:9"),
    ("ls", "s3://"),
    ("ls", "s3://bucket/x", "--endpoint", "127.0.0.1:9"),
    ("ls", "s3://bucket/x", "--endpoint", "http://127.0.0.1:99999"),
    ("ls", "s3://bucket/x", "--endpoint", "http://[::1:9"),
    ("ls", "s3://bucket/x", "--endpoint", "http://127.0.0.1:9", "--no-path-style"),
    ("ls", "{p}/damaged"),
    ("export", MISSING, "{p}/out.safetensors"),
    ("export", RUN, "{p}/run"),  # exists, no --force
    ("export", RUN, "{p}/o.safetensors", "--step", "-3"),
    ("export", RUN, "{p}/o.safetensors", "--dtype", "int8"),
    ("export", RUN, "{p}/o.safetensors", "--only", "nothing"),
    ("export", RUN, "{p}/o.safetensors", "--config", FILE),
    ("export", RUN, "{p}/hf", "--format", "hf", "--config", MISSING),
    ("export", RUN, "{p}/hf", "--format", "hf", "--max-shard-size", "0"),
    ("export", RUN, "{p}/hf", "--format", "hf", "--max-shard-size", "abc"),
    ("export", RUN, "{p}/no/such/dir/o.safetensors"),
    ("convert", MISSING, "{p}/c", "--to", "unbroken"),
    ("convert", RUN, "{p}/c", "--to", "unbroken", "--trust-pickle"),
    ("convert", EMPTY, "{p}/c", "--to", "unbroken"),
    ("convert", RUN, "{p}/c"),  # --to MISSING
    ("convert", RUN, "{p}/c", "--to", "dcp", "--step", "-1"),
    ("gc", RUN),
    ("gc", RUN, "--keep-last", "0"),
    ("gc", RUN, "--keep-last", "-2"),
    ("gc", RUN, "--keep-every", "0"),
    ("gc", RUN, "--keep-last", "x"),
    ("gc", RUN, "--keep-per-window", "abc"),
    ("gc", RUN, "--keep-per-window", "0"),
    ("gc", RUN, "--keep-per-window", "-1h"),
    ("gc", RUN, "--keep-best", "1", "--dry-run"),  # no step has a metric
    ("tokenise", MISSING, "-o", "{p}/t.tokens"),
    ("tokenise", FILE),  # no -o
    ("tokenise", FILE, "-o", "{p}/t.tokens", "--eos", "-1"),
    ("tokenise", FILE, "-o", "{p}/t.tokens", "--tokenizer", MISSING),
    ("tokenise", "--verify", FILE),
    ("tokenise", "--verify", MISSING),
    ("simulate", "--gpus", "0"),
    ("simulate", "--gpus", "-8"),
    ("simulate", "--gpus", "many"),
    ("simulate", "--mix", "abc"),
    ("simulate", "--mix", "1,1"),
    ("simulate", "--step-s", "0"),
    ("simulate", "--days", "-1"),
    ("simulate", "--seeds", "0"),
    ("simulate", "--interval", "0"),
    ("simulate", "--results", MISSING),
    ("simulate", "--results", FILE),
    ("simulate", "--results", "{p}/notes.txt"),
    ("goodput", MISSING),
    ("goodput", EMPTY),
    ("goodput", FILE),
    ("demo", "--steps", "0"),
    ("demo", "--steps", "x"),
    ("demo", "--kill-at", "0"),
    ("demo", "--save-every", "-1"),
    ("run", "{p}/missing.py"),
    ("run",),
    ("run", "--inject-fault", "explode rank=1", "{p}/notes.txt"),
    ("run", "--heartbeat-timeout", "-1", "{p}/notes.txt"),
    ("coordinator", "--port", "-1"),
    ("coordinator", "--node-timeout", "0"),
    ("coordinator", "--secret-file", MISSING),
]


@pytest.mark.timeout(300)
def test_bad_input_never_shows_a_traceback_and_exits_with_a_documented_code(
    place: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(place)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    wrong = []
    for case in CASES:
        argv = [a.format(p=place) for a in case]
        try:
            code = main(argv)
        except BaseException as e:  # what escapes main is a traceback for the user
            wrong.append(f"unbroken {' '.join(case)}: raised {type(e).__name__}: {e}")
            continue
        out, err = capsys.readouterr()
        if TRACEBACK in out + err or code not in DOCUMENTED or not (out + err).strip():
            wrong.append(f"unbroken {' '.join(case)}: exit {code}\n{err[-800:]}")
    assert not wrong, "\n\n".join(wrong)


def test_the_exit_codes_the_sweep_accepts_are_the_documented_ones() -> None:
    assert "1  damage found" in EXIT_CODES and "2  usage or input error" in EXIT_CODES


def test_ls_lists_the_intact_steps_beside_a_damaged_manifest(
    place: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", str(place / "damaged")]) == 1
    out = capsys.readouterr().out
    rows = [line.split("│")[1:3] for line in out.splitlines() if line.startswith("│")]
    assert [[c.strip() for c in row] for row in rows] == [["5", "232 B"], ["10", "DAMAGED"]]
    assert f"DAMAGED step 10: {place / 'damaged' / step_dir(10) / 'manifest.json'}" in out
    assert main(["ls", str(place / "damaged"), "--json"]) == 1
    listed = capsys.readouterr().out
    assert '"step": 5' in listed and '"damaged":' in listed


def test_gc_keep_best_without_metrics_says_so_and_deletes_nothing(
    place: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gc", str(place / "run"), "--keep-best", "1"]) == 2
    assert "none of the 2 steps" in capsys.readouterr().err
    assert (place / "run" / step_dir(5)).is_dir()


def test_convert_of_a_folder_that_is_not_dcp_warns_about_nothing_it_would_unpickle(
    place: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["convert", str(place / "run"), str(place / "c2"), "--to", "unbroken"]
    assert main([*argv, "--trust-pickle"]) == 2
    err = capsys.readouterr().err
    assert "is not a DCP checkpoint: it has no .metadata file" in err
    assert "warning" not in err.lower() and "unpickl" not in err.lower()


def test_hf_export_without_config_says_what_the_folder_lacks(
    place: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = place / "hf-no-config"
    assert main(["export", str(place / "run"), str(out), "--format", "hf", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "no --config" in err and "config.json" in err and "from_pretrained" in err
    assert not (out / "config.json").exists()


def test_an_s3_endpoint_without_a_scheme_is_named_not_a_builder_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:5055")
    assert main(["ls", "s3://bucket/x"]) == 2
    err = capsys.readouterr().err
    assert "AWS_ENDPOINT_URL=127.0.0.1:5055 is not an http:// or https:// URL" in err
    assert "http://127.0.0.1:5055" in err and "builder error" not in err


def test_the_cli_reaches_an_s3_endpoint_given_by_its_options(
    bucket: tuple[str, dict], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, options = bucket
    with unbroken.Checkpointer(uri, storage_options=options) as ckpt:
        ckpt.save(3, {"model": torch.nn.Linear(2, 2)})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    flags = ["--endpoint", options["endpoint"], "--region", "us-east-1", "--path-style"]
    assert main(["ls", uri, *flags]) == 0
    assert "│ 3 " in capsys.readouterr().out
    assert main(["verify", uri, *flags]) == 0
    assert "OK step 3" in capsys.readouterr().out


def _run(*argv: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unbroken", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", ["--help", "ls", "show", "verify"])
def test_reading_commands_start_without_torch(command: str, place: Path) -> None:
    """The commands of the first hour import neither torch nor numpy (seconds of start-up
    each): help, and reading a checkpoint, down to every checksum."""
    argv = [command] if command == "--help" else [command, str(place / "run")]
    probe = (
        f"import sys; from unbroken.cli.main import main; code = main({argv!r}); "
        "sys.stderr.write(str(sorted(m for m in ('torch', 'numpy') if m in sys.modules))); "
        "sys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr.strip() == "[]", proc.stderr
    assert command == "--help" or "10" in proc.stdout  # the newest step, listed


@pytest.mark.timeout(120)
def test_show_into_a_pipe_closed_early_exits_0_quietly(place: Path) -> None:
    """`unbroken show ... | head -1`: the reader leaves; as with the shell's own tools,
    no error, and not exit 1, which says "damage found"."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "show", str(place / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # before it wrote the rest: its next write finds no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""
