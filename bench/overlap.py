"""Overlapped saves: unbroken's background save with its copy beside the next forward and
backward (`unbroken.job.overlap`), the same save copied before it returns
(``overlap=False``), DCP's ``async_save`` with its ``DefaultStager`` staging in the
background (thread and process writers), and torch-checkpointing's ``CheckpointManager``
(PyPI 0.1.1, ``pip install torch-checkpointing``; buffered writes: its O_DIRECT default
fails on this disk), next to this machine's memcpy of the same bytes, in one run.

    python bench/overlap.py                          # 2 ranks x ~192 MiB of AdamW state
    python bench/overlap.py --mib 16 --repeats 1     # smoke, well under a minute

The job: an MLP trained with AdamW, one thread per rank, 2 ranks on the 2 cores, so a
background copy takes cycles from training as it would on a busy host. The ranks are
data-parallel replicas (the same weights and batches, as after DDP's all-reduce): DCP
and unbroken both write such a replicated tensor once. Each method runs `STEPS` steps
with a save after every `EVERY`-th, against the same steps with no save before and
after (the loss is the difference from the quieter of the two); staging memory is
allocated ahead where the library offers it; a method's staging is waited for the way
its documentation says before the next optimizer step (DCP: ``staging_completion``;
torch-checkpointing: ``with manager.lock(): optimizer.step()``; unbroken: nothing, its
optimizer step pre-hook does it). Each save of the first repeat is restored into a fresh
model and compared, bit for bit, with the values at the save. Reported for the slowest
rank: the time ``save`` blocks the loop, the step time lost, and the write rate to
durable (from the call to the save's completion, the training going on meanwhile).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import unbroken
from common import (
    MIB,
    free_port,
    hand_back,
    join_gloo,
    leave_group,
    max_over_ranks,
    new_table,
    print_result,
    read_back,
    rotated,
    run_ranks,
    show,
)

STEPS, EVERY, BATCH = 20, 10, 8
METHODS = (
    *("unbroken", "unbroken_copy", "dcp_thread", "dcp_process", "torch_checkpointing"),
    *("snapshot", "snapshot_copy"),
)
LABELS = {
    "unbroken": "unbroken, overlapped",
    "unbroken_copy": "unbroken, overlap=False",
    "dcp_thread": "DCP async_save + DefaultStager, thread",
    "dcp_process": "DCP async_save + DefaultStager, process",
    "torch_checkpointing": "torch-checkpointing CheckpointManager, buffered IO",
    "snapshot": "unbroken snapshot every step, overlapped",
    "snapshot_copy": "unbroken snapshot every step, overlap=False",
}


def make_model(mib: int, seed: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """Parameters of ``mib`` / 3 MiB (AdamW keeps two more of the same): about ``mib``."""
    width = int(((mib * MIB / 3 / 4) / 4) ** 0.5)  # four square layers
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, guard: Any) -> None:
    width = next(model.parameters()).shape[1]
    optim.zero_grad()
    model(torch.randn(BATCH, width)).pow(2).mean().backward()
    guard(lambda: optim.step())


def values(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [v.clone() for v in model.state_dict().values()]
    return out + [v.clone() for s in optim.state.values() for v in s.values()]


class Method:
    """One library's background save of ``{"model", "optim"}`` into ``root``."""

    def __init__(self, name: str, root: Path, model: nn.Module, optim: Any) -> None:
        self.name, self.root, self.model, self.optim = name, root, model, optim
        self.pending: Any = None
        if name.startswith("unbroken"):
            self.ckpt = unbroken.Checkpointer(root, overlap=name == "unbroken", keep=None)
        if name.startswith("snapshot"):
            self.ckpt = self.memory(overlap=name == "snapshot")
        if name.startswith("dcp"):
            self.stager = DefaultStager(StagingOptions(False, False, True, False))
            self.staging: Any = None
        if name == "torch_checkpointing":
            from torch_checkpointing import CheckpointManager
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

            # Its default O_DIRECT writes fail here (EINVAL closing a file's unaligned
            # tail, ext4): buffered writes, otherwise as its README runs it.
            storage = LocalFileSystemStorageConfig(use_direct_io=False)
            self.manager = CheckpointManager.Config(storage_config=storage).build()

    def memory(self, overlap: bool = True) -> unbroken.Checkpointer:
        shm = str(self.root / "shm")  # node-local memory: a folder on disk is enough here
        return unbroken.Checkpointer(self.root, memory=True, memory_dir=shm, overlap=overlap)

    def state(self) -> dict[str, Any]:
        if self.name.startswith(("unbroken", "snapshot")):
            return {"model": self.model, "optim": self.optim}
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def save(self, step: int) -> None:
        if self.name.startswith("unbroken"):
            self.pending = self.ckpt.save(step, self.state(), blocking=False).wait
        elif self.name.startswith("snapshot"):
            self.ckpt.snapshot(step, self.state())
            self.pending = self.ckpt.wait
        elif self.name.startswith("dcp"):
            process = "process" in self.name
            got = dcp.async_save(
                self.state(), checkpoint_id=str(self.root / str(step)), async_stager=self.stager,
                async_checkpointer_type=(
                    AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
                ),
            )  # fmt: skip
            assert isinstance(got, AsyncSaveResponse)  # what an async stager makes it return
            self.staging = got.staging_completion
            self.pending = got.upload_completion.result
        else:
            written = self.manager.save(str(self.root / str(step)), self.state())
            assert written is not None  # an async saver's write future
            self.pending = written.result

    def prepare(self) -> None:
        """Staging memory allocated ahead, where the library can (a script does it once)."""
        if self.name.startswith("unbroken"):
            self.ckpt.prepare(self.state())
        elif self.name.startswith("snapshot"):
            for step in range(3):  # every slot mapped and touched, as after a few steps
                self.save(step)
        elif self.name == "torch_checkpointing":
            self.manager.prewarm_staging(self.state())
        time.sleep(1.0)  # done, and the machine quiet again, before anything is timed

    def guard(self, step: Callable[[], None]) -> None:
        """The optimizer step, as each library says to run it while a save stages."""
        if self.name.startswith("dcp") and self.staging is not None:
            self.staging.result()
            self.staging = None
        if self.name == "torch_checkpointing":
            with self.manager.lock():
                step()
            return
        step()

    def load(self, step: int, model: nn.Module, optim: Any) -> None:
        if self.name.startswith("unbroken"):
            with unbroken.Checkpointer(self.root) as ckpt:
                ckpt.restore({"model": model, "optim": optim}, step)
            return
        if self.name.startswith("snapshot"):  # the newest, from memory
            with self.memory() as ckpt:
                assert ckpt.restore({"model": model, "optim": optim}) == step
            return
        into = {"model": model.state_dict(), "optim": optim.state_dict()}
        if self.name.startswith("dcp"):
            dcp.load(into, checkpoint_id=str(self.root / str(step)))
        else:
            self.manager.load(str(self.root / str(step)), into=into)
        model.load_state_dict(into["model"])
        optim.load_state_dict(into["optim"])

    def close(self) -> None:
        if self.name.startswith(("unbroken", "snapshot")):
            self.ckpt.close()
        elif self.name.startswith("dcp"):
            self.stager.close()
        else:
            self.manager.close()


def run_method(name: str, root: Path, mib: int, check: bool) -> dict[str, float]:
    """`STEPS` steps without saves, then `STEPS` with one after every `EVERY`-th (half a
    period in, so each save's whole cost lands inside them); the numbers."""
    model, optim = make_model(mib, 0)  # data-parallel replicas: the same on every rank
    method = Method(name, root, model, optim)
    for _ in range(2):  # AdamW's state exists; the first steps' one-off costs are paid
        train_step(model, optim, method.guard)
    method.prepare()
    base = steps_s(model, optim, method)
    blocked, excluded, called = [], 0.0, 0.0
    saved: dict[int, list[torch.Tensor]] = {}
    dist.barrier()
    start = time.perf_counter()
    every_step = name.startswith("snapshot")
    for n in range(10, STEPS + 10):
        train_step(model, optim, method.guard)
        if every_step or n % EVERY == EVERY // 2:
            if method.pending is not None and not every_step:
                method.pending()
            if check:  # off the clock; of snapshots, the newest is checked
                cloned = time.perf_counter()
                saved = {**({} if every_step else saved), n: values(model, optim)}
                excluded += time.perf_counter() - cloned
            called = time.perf_counter()
            method.save(n)
            blocked.append(time.perf_counter() - called)
    loaded = time.perf_counter() - start - excluded
    method.pending()
    durable = time.perf_counter() - called
    base = min(base, steps_s(model, optim, method))  # the quieter of before and after
    wrong = sum(_wrong(method, n, want, mib) for n, want in saved.items())
    method.close()
    return {
        "block_s": max(blocked),
        "lost": loaded / base - 1,
        "durable_s": durable,
        "wrong": wrong,
    }


def steps_s(model: nn.Module, optim: torch.optim.Optimizer, method: Method) -> float:
    """`STEPS` steps with nothing saved."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(STEPS):
        train_step(model, optim, method.guard)
    return time.perf_counter() - start


def _wrong(method: Method, step: int, want: list[torch.Tensor], mib: int) -> int:
    """How many tensors of the save of ``step`` differ from the values at the save."""
    model, optim = make_model(mib, seed=99)
    train_step(model, optim, lambda s: s())
    method.load(step, model, optim)
    return sum(not torch.equal(a, b) for a, b in zip(values(model, optim), want, strict=True))


def memcpy_s(mib: int) -> float:
    """This machine's limit: the state's bytes copied into memory already touched, by
    every rank at once (best of 3)."""
    model, optim = make_model(mib, dist.get_rank())
    train_step(model, optim, lambda s: s())
    tensors = values(model, optim)
    into = [torch.empty_like(t) for t in tensors]
    for dst, src in zip(into, tensors, strict=True):
        dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for dst, src in zip(into, tensors, strict=True):
            dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def worker(rank: int, port: int, root: str, mib: int, repeats: int, methods: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's process writer meets its peers there
    join_gloo(rank, 2, port, timeout_s=300)
    out: dict[str, Any] = {"memcpy_s": [], "methods": {m: [] for m in methods}}
    for rep in range(repeats):
        out["memcpy_s"].append(max_over_ranks(memcpy_s(mib))[0])
        for name in rotated(methods, rep):
            where = Path(root) / f"{name}-{rep}"
            got = run_method(name, where, mib, check=rep == 0)
            worst = max_over_ranks(got["block_s"], got["lost"], got["durable_s"], got["wrong"])
            out["methods"][name].append(dict(zip(got, worst, strict=True)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)
    out["nbytes"] = sum(t.nbytes for t in values(*_stepped(mib)))
    hand_back(root, out)
    leave_group()


def _stepped(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optim = make_model(mib, 0)
    train_step(model, optim, lambda s: s())
    return model, optim


def available() -> list[str]:
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError:
        print("torch-checkpointing is not installed (pip install torch-checkpointing): left out")
        return [m for m in METHODS if m != "torch_checkpointing"]
    return list(METHODS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=192, help="state per rank, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    methods = available()
    root = tempfile.mkdtemp(prefix="unbroken-overlap-")
    try:
        run_ranks(worker, (free_port(), root, opts.mib, opts.repeats, methods), 2)
        report(read_back(root), methods)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(out: dict[str, Any], methods: list[str]) -> None:
    memcpy = min(out["memcpy_s"])
    gib = 2 * out["nbytes"] / 2**30
    table = new_table(
        f"Background saves of {out['nbytes'] / MIB:.0f} MiB of AdamW state per rank, 2 ranks",
        f"medians of the slowest call; a save after every {EVERY} of {STEPS} steps, or a "
        f"snapshot after each; limit: memcpy {memcpy * 1e3:.1f} ms",
        [("method", "left"), ("blocks", "right"), ("% of memcpy", "right"),
         ("step time lost", "right"), ("to durable", "right"), ("restored", "left")],
    )  # fmt: skip
    result: dict[str, Any] = {"memcpy_ms": round(memcpy * 1e3, 2)}
    for name in methods:
        runs = out["methods"][name]
        block = statistics.median(r["block_s"] for r in runs)
        lost = statistics.median(r["lost"] for r in runs)
        in_memory = name.startswith("snapshot")  # nothing durable: shared memory
        rate = 0.0 if in_memory else gib / statistics.median(r["durable_s"] for r in runs)
        wrong = int(runs[0]["wrong"])
        table.add_row(
            LABELS[name], f"{block * 1e3:.1f} ms", f"{100 * block / memcpy:.0f} %",
            f"{100 * lost:+.1f} %", "in memory" if in_memory else f"{rate:.2f} GiB/s",
            "bitwise" if not wrong else f"{wrong} tensor(s) differ",
        )  # fmt: skip
        result[name] = {
            "block_ms": round(block * 1e3, 2), "block_of_memcpy": round(block / memcpy, 3),
            "lost": round(lost, 4), "durable_gib_s": round(rate, 3), "wrong": wrong,
        }  # fmt: skip
    show(110, table)
    print_result(result)


if __name__ == "__main__":
    main()
