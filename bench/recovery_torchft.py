"""torchft's own healing on bench/recovery.py's job, for a side-by-side figure.

    python bench/recovery_torchft.py --mib-per-rank 256 --fault-step 80   # needs .[bench]

torchft 0.2 on CPU with gloo, as its README runs it: a Lighthouse
(``torchft_lighthouse``) and --groups one-rank replica groups, each under its own
``torchrun --max-restarts 1``. Every group trains bench/recovery_worker.py's model (same
width for --mib-per-rank, same data) with ``torchft.Manager`` (gradients all-reduced
through ``manager.allreduce``, not torchft's DDP wrapper, which crashed the survivor when
its peer died mid-allreduce) and ``torchft.Optimizer``. The last group SIGKILLs itself
after --fault-step; torchrun restarts it and it heals from a live peer over torchft's
HTTP checkpoint transport. Measured: fault -> the survivors' next committed step
("resume", which may be the step already in flight), the survivors' longest gap between
two commits in the 15 s after the fault ("stall": the lighthouse noticing the dead group),
and fault -> the killed group's first committed step after healing ("healed"). The survivors
must still be training when the killed group comes back (--steps-after: at 256 MiB a step
takes ~0.1 s here; with a tiny model use many more steps), or it trains alone. Ends with
``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from common import print_result

HERE = Path(__file__).resolve()


def trainer(args: argparse.Namespace) -> None:
    """One replica group's rank (under torchrun)."""
    import torch
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from recovery_worker import EXPERTS, Model, batch, width_for

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Model(width_for(args.mib_per_rank))
    base = torch.optim.AdamW(model.parameters(), lr=1e-4)
    group = int(os.environ["REPLICA_GROUP_ID"])
    out = open(Path(args.out) / f"group-{group}.jsonl", "a")  # noqa: SIM115

    def log(event: str, **kw: object) -> None:
        out.write(json.dumps({"event": event, "t": time.time(), "group": group, **kw}) + "\n")
        out.flush()

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]), base.load_state_dict(sd["optim"])
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": base.state_dict()},
        min_replica_size=1,
        replica_id=f"group-{group}",
        timeout=timedelta(seconds=10),
    )  # fmt: skip
    optim = Optimizer(manager, base)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log("start", attempt=attempt)
    while manager.current_step() < args.steps:
        step = manager.current_step() + 1
        optim.zero_grad()  # starts the quorum; a restarted group heals here
        x, y = batch(step, group)
        h = model.trunk(x)
        h = h + model.experts[step % EXPERTS](h)
        loss = (model.head(h) - y).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                manager.allreduce(p.grad).wait()
        before = manager.current_step()
        optim.step()  # commits only if every group's all-reduce succeeded
        if manager.current_step() > before:
            log("step_done", step=manager.current_step(), attempt=attempt)
        everyone = manager.num_participants() == args.groups  # not while one trains alone
        if attempt == 0 and group == args.groups - 1 and everyone and before >= args.fault_step:
            log("fault", step=manager.current_step())
            os.kill(os.getpid(), signal.SIGKILL)
    manager.shutdown()


def launch(args: argparse.Namespace, out: Path) -> dict[str, object]:
    lighthouse = subprocess.Popen(
        ["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100",
         "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", "1000", "--bind", "[::]:29510"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    groups = []
    try:
        time.sleep(1.0)
        for g in range(args.groups):
            env = {
                **os.environ,
                "REPLICA_GROUP_ID": str(g),
                "NUM_REPLICA_GROUPS": str(args.groups),
                "TORCHFT_LIGHTHOUSE": "http://localhost:29510",
                "OMP_NUM_THREADS": "1",
            }
            # One torchrun per replica group, its store on a port of its own.
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                "--max-restarts=1", f"--master-port={29600 + g}", str(HERE), "--trainer",
                *sys.argv[1:], f"--out={out}",
            ]  # fmt: skip
            with open(out / f"group-{g}.log", "w") as log:
                groups.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=600) for p in groups]
    finally:
        for p in [*groups, lighthouse]:
            if p.poll() is None:
                p.kill()
                p.wait()
    return analyse(args, out, codes)


def analyse(args: argparse.Namespace, out: Path, codes: list[int]) -> dict[str, object]:
    events = []
    for path in out.glob("group-*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines()]
    faults = [e for e in events if e["event"] == "fault"]
    if not faults:
        for log in sorted(out.glob("group-*.log")):
            print(f"{log.name}:\n" + "\n".join(log.read_text().splitlines()[:40]))
        return {"failed": f"no fault fired; exit codes {codes}"}
    fault = faults[0]["t"]
    after = [e for e in events if e["event"] == "step_done" and e["t"] > fault]
    killed = args.groups - 1
    resume = sorted(e["t"] for e in after if e["group"] != killed)
    gaps = [b - a for a, b in zip([fault, *resume], resume, strict=False) if b - fault < 15]
    healed = [e for e in after if e["group"] == killed]
    return {
        "exit_codes": codes,
        "fault_step": faults[0]["step"],
        "survivors_resume_s": round(min(resume) - fault, 3) if resume else None,
        "survivors_longest_stall_s": round(max(gaps), 3) if gaps else None,
        "healed_s": round(healed[0]["t"] - fault, 3) if healed else None,
        "healed_at_step": healed[0]["step"] if healed else None,
        "killed_group_steps_after": [e["step"] for e in healed][:8],
        "survivor_steps_after": sorted(e["step"] for e in after if e["group"] != killed)[:8],
        "last_step": max((e["step"] for e in events if e["event"] == "step_done"), default=None),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib-per-rank", type=float, default=256)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--fault-step", type=int, default=80)
    p.add_argument(
        "--steps-after", type=int, default=100, help="long enough for the killed group to heal"
    )
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.fault_step + args.steps_after
    if args.trainer:
        trainer(args)
        return
    out = Path(tempfile.mkdtemp(prefix="unbroken-torchft-"))
    try:
        result = launch(args, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print_result({"torchft": result, "config": vars(args) | {"out": None}})


if __name__ == "__main__":
    main()
