"""Warm spares (`unbroken.run.spare`) and the template they are forked from
(`unbroken.run.template`), driven directly: a real store, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken.run import contract, listen
from unbroken.run.procs import kill_tree
from unbroken.run.spare import Spares


def _env(store, **more: str) -> dict[str, str]:
    return {**os.environ, "MASTER_ADDR": listen.LOOPBACK, "MASTER_PORT": str(store.port), **more}


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    """Running, not ended (a zombie its new parent has not reaped yet counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _ready(store, key: str, timeout: float = 45) -> int:
    deadline = time.monotonic() + timeout
    while not store.check([f"{key}/{contract.SPARE_READY}"]):
        assert time.monotonic() < deadline, f"spare {key} never got ready"
        time.sleep(0.05)
    return int(store.get(f"{key}/{contract.SPARE_READY}"))


@pytest.mark.timeout(90)
def test_spares_are_forked_from_one_template_that_imports_once(tmp_path):
    """Every spare is forked from one template that made the script's imports (a failing
    import left to the script) once: no spare imports again, and each runs its rank,
    its exit status read through the template (the spares' parent)."""
    (tmp_path / "heavy.py").write_text(
        "import os\nopen(os.environ['IMPORTS'], 'a').write(f'{os.getpid()}\\n')\n"
    )
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\nimport heavy\nfrom xml.dom import minidom\n"
        "try:\n    import no_such_module_here\nexcept ImportError:\n    pass\n"
        "nvml = os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK', '')\n"  # the template's only
        "open(sys.argv[1], 'w').write(os.environ['RANK'] + nvml)\n"
        "sys.exit(int(os.environ['RANK']))\n"
    )
    imports = tmp_path / "imports"
    store = listen.store()
    # "0": the rank's own value (lightning_fabric sets "1" in this process at import).
    ranks_env = {"IMPORTS": str(imports), "PYTORCH_NVML_BASED_CUDA_CHECK": "0"}
    spares = Spares(store, lambda: _env(store, **ranks_env), ([str(script)], False))
    spares.start(2)
    try:
        pids = [_ready(store, key) for key in spares.idle]
        assert spares.template is not None
        template = spares.template.proc.pid
        assert [_parent(pid) for pid in pids] == [template, template]
        assert [os.getsid(pid) for pid in pids] == pids, "each spare in a session of its own"
        assert imports.read_text().split() == [str(template)], "heavy not imported in advance"
        first, second = spares.idle
        taken = [spares.take(), spares.take(), spares.take()]
        assert [t.key if t else None for t in taken[:2]] == [first, second]
        assert all(t and t.ready for t in taken[:2]) and spares.owed == 2
        assert taken[2] is not None and not taken[2].ready, "the empty pool forks one now"
        assert spares.owed == 2, "a spare forked for an empty pool is owed to no one"
        for rank, t in enumerate(taken):
            assert t is not None
            argv = [str(script), str(tmp_path / f"out{rank}")]
            spares.assign(t.key, {"RANK": str(rank)}, argv, False)
        assert [t.proc.wait(timeout=45) for t in taken if t] == [0, 1, 2]
        assert [(tmp_path / f"out{r}").read_text() for r in range(3)] == ["00", "10", "20"]
        assert imports.read_text().split() == [str(template)], "imported again"
    finally:
        spares.stop()
    assert spares.template.proc.returncode is not None


@pytest.mark.timeout(60)
def test_a_killed_spare_and_a_killed_template_are_seen_as_ended():
    """The status of a spare killed by a signal comes through its template; a spare
    outliving a killed template is still seen to end."""
    store = listen.store()
    spares = Spares(store, lambda: _env(store))
    spares.start(2)
    try:
        pids = [_ready(store, key) for key in spares.idle]
        a, b = (spares.take() for _ in pids)
        assert a is not None and b is not None and [a.proc.pid, b.proc.pid] == pids
        os.kill(a.proc.pid, signal.SIGKILL)
        assert a.proc.wait(timeout=10) == -signal.SIGKILL
        assert spares.template is not None
        spares.template.proc.kill()
        assert b.proc.poll() is None, "alive while only its template is gone"
        os.kill(b.proc.pid, signal.SIGKILL)
        assert b.proc.wait(timeout=10) == -signal.SIGKILL
        assert spares.take() is None, "no template: no spare (the caller starts one cold)"
    finally:
        spares.stop()


@pytest.mark.timeout(30)
def test_killing_a_tree_spares_a_live_group_leader_outside_it():
    """`kill_tree` of a process still in its parent's process group (a spare forked a
    moment ago, before it took its own session) kills that process, not the group: the
    group's leader (the template) and its other members live on."""
    child = "import os, time; os.fork(); time.sleep(60)"  # two members of the group
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]);"
    leader = subprocess.Popen(
        [sys.executable, "-c", code + "time.sleep(60)"], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 20
        while len(members := _group(leader.pid)) < 3:
            assert time.monotonic() < deadline, "the group never formed"
            time.sleep(0.05)
        victim = next(p for p in members if p != leader.pid and _parent(p) == leader.pid)
        killed = kill_tree(victim)
        assert len(killed) == 2 and leader.pid not in killed
        time.sleep(0.2)
        assert _alive(leader.pid), "the template's group was killed with its spare"
        assert not any(_alive(p) for p in killed)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def _group(pgid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.timeout(60)
def test_a_cold_spare_makes_its_own_imports_and_runs_its_rank(tmp_path):
    """What a fork of a template whose imports initialised CUDA becomes (`spare._cold`):
    the same process, a fresh interpreter that imports for itself, then a spare."""
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ['RANK'])\n")
    store = listen.store()
    env = _env(store, **{contract.SPARE_SCRIPT_ENV: json.dumps([str(script), False])})
    cold = subprocess.Popen(
        [sys.executable, "-m", "unbroken.run.spare", "--cold", "spare/c"], env=env
    )
    try:
        assert _ready(store, "spare/c") == cold.pid
        Spares(store, dict).assign(
            "spare/c", {"RANK": "5"}, [str(script), str(tmp_path / "out")], False
        )
        assert cold.wait(timeout=45) == 0
        assert (tmp_path / "out").read_text() == "5"
    finally:
        cold.kill()


@pytest.mark.timeout(60)
def test_an_idle_spare_whose_supervisor_dies_ends_at_once():
    """An idle spare blocks in one store wait (no polling); a supervisor killed while it
    waits must not leave it, or its template, behind: both end within a second or so."""
    store = listen.store()
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, time\n"
            "from unbroken.run.spare import Spares\n"
            "Spares(None, lambda: dict(os.environ)).start()\n"
            "time.sleep(120)\n",
        ],
        env=_env(store),
    )
    try:
        deadline = time.monotonic() + 45
        while not (keys := [k for k in _keys(store) if k.endswith(contract.SPARE_READY)]):
            assert time.monotonic() < deadline, "the spare never got ready"
            time.sleep(0.05)
        pid = int(store.get(keys[0]))
        template = _parent(pid)
        supervisor.kill()
        supervisor.wait()
        deadline = time.monotonic() + 3
        while _alive(pid) or _alive(template):
            assert time.monotonic() < deadline, "the orphaned spare or template still runs"
            time.sleep(0.05)
    finally:
        supervisor.kill()


def _keys(store) -> list[str]:
    """The spare keys in ``store``: spares name themselves only there."""
    return [k for k in store.list_keys() if k.startswith(contract.SPARE_PREFIX)]
