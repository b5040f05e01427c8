"""The sections of bench/gpu.py that compare with DCP: CUDA staging against DCP's stager,
and the overlapped capture on CUDA; and what every section shares (`Ctx`, `Section`).

Each runs on one model (an MLP of four square layers and its AdamW state: ``mib`` MiB in
all) on the device, or on the CPU with ``--cpu-dry-run``, and checks every save it times,
restored into a fresh model, against the values at the save, bit for bit. No process
group: one rank, as `unbroken.Checkpointer` and DCP both allow.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import unbroken

MIB = 1 << 20
REPEATS = 3  # timed saves per method (after one untimed save that allocates)
AFTER = 3  # training steps timed after each save of the overlap section

Guard = Callable[[Callable[[], Any]], None]


@dataclass(frozen=True, kw_only=True)
class Ctx:
    """Where a section runs: ``device`` ("cuda", or "cpu" for --cpu-dry-run), the state's
    size, the training batch, and a fresh directory of its own."""

    device: str
    mib: int
    batch: int
    work: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@dataclass
class Section:
    """What a section found: table rows (what, measured, check), the wrong values, and
    its numbers for the RESULT line."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)

    def check(self, what: str, ok: bool, detail: str, good: str = "bitwise") -> str:
        """The check column: ``good``, or WRONG with ``detail`` (kept in ``wrong``)."""
        if ok:
            return good
        self.wrong.append(f"{what}: {detail}")
        return f"WRONG: {detail}"


# --------------------------------------------------------------------------- the model


def make_model(ctx: Ctx, seed: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """Parameters of ``mib`` / 3 MiB (AdamW keeps two more of the same), on the device."""
    width = int(((ctx.mib * MIB / 3 / 4) / 4) ** 0.5)
    torch.manual_seed(seed)
    layers = [
        nn.Sequential(nn.Linear(width, width, device=ctx.device), nn.Tanh()) for _ in range(4)
    ]
    model = nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: int, guard: Guard) -> None:
    first = next(model.parameters())
    optim.zero_grad()
    model(torch.randn(batch, first.shape[1], device=first.device)).pow(2).mean().backward()
    guard(optim.step)


def plain(step: Callable[[], Any]) -> None:
    step()


def stepped(ctx: Ctx, seed: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """A model whose optimizer has stepped twice: its state exists and is on the device."""
    model, optim = make_model(ctx, seed)
    for _ in range(2):
        train_step(model, optim, ctx.batch, plain)
    return model, optim


def values(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state, cloned (on its device)."""
    out = [v.clone() for v in model.state_dict().values()]
    return out + [v.clone() for s in optim.state.values() for v in s.values()]


def differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """How many tensors of ``a`` differ from ``b`` (device and bytes compared)."""
    return sum(x.device != y.device or not torch.equal(x, y) for x, y in zip(a, b, strict=True))


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 2**30:.2f} GiB/s"


# --------------------------------------------------------------------------- two libraries


class Saver:
    """One library's background save of ``{"model", "optim"}`` into ``root``:
    ``unbroken`` (overlapped), ``unbroken_copy`` (``overlap=False``), or ``dcp``
    (``async_save`` with a ``DefaultStager``: pinned memory and non-blocking copies on
    CUDA, as its documentation suggests for GPUs; plain on the CPU)."""

    def __init__(self, name: str, root: Path, model: nn.Module, optim: Any, cuda: bool) -> None:
        self.name, self.root, self.model, self.optim, self.cuda = name, root, model, optim, cuda
        self.pending: Callable[[], Any] = lambda: None
        self.staging: Any = None
        if name == "dcp":
            self.stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
        else:
            self.ckpt = unbroken.Checkpointer(root, overlap=name == "unbroken", keep=None)

    def state(self) -> dict[str, Any]:
        if self.name == "dcp":
            return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}
        return {"model": self.model, "optim": self.optim}

    def save(self, step: int) -> None:
        if self.name != "dcp":
            self.pending = self.ckpt.save(step, self.state(), blocking=False).wait
            return
        if self.cuda:
            # DCP's staging stream does not wait for the compute stream (its
            # DefaultStager copies on a stream of its own from a thread): without this,
            # it may copy values the queued optimizer step has not written yet.
            torch.cuda.current_stream().synchronize()
        got = dcp.async_save(
            self.state(), checkpoint_id=str(self.root / str(step)), async_stager=self.stager
        )
        assert isinstance(got, AsyncSaveResponse)  # what an async stager makes it return
        self.staging, self.pending = got.staging_completion, got.upload_completion.result

    def staged(self) -> None:
        """Wait until the copy of the last save is in host memory (``unbroken_copy``:
        the current stream waits for its side stream, so a device sync covers it)."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        elif self.cuda:
            torch.cuda.synchronize()

    def guard(self, step: Callable[[], Any]) -> None:
        """The optimizer step, as each library says to run it while a save stages:
        DCP's staging is waited for; unbroken's optimizer step pre-hook does it."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        step()

    def prepare(self) -> None:
        """Staging memory allocated ahead, where the library can."""
        if self.name != "dcp":
            self.ckpt.prepare(self.state())

    def load(self, step: int, model: nn.Module, optim: Any) -> None:
        if self.name != "dcp":
            with unbroken.Checkpointer(self.root) as ckpt:
                ckpt.restore({"model": model, "optim": optim}, step)
            return
        into = {"model": model.state_dict(), "optim": optim.state_dict()}
        dcp.load(into, checkpoint_id=str(self.root / str(step)))
        model.load_state_dict(into["model"])
        optim.load_state_dict(into["optim"])

    def close(self) -> None:
        if self.name == "dcp":
            self.stager.close()
        else:
            self.ckpt.close()


def wrong_after_load(ctx: Ctx, saver: Saver, step: int, want: list[torch.Tensor]) -> int:
    """How many tensors of the save of ``step``, restored into a fresh model on the
    device, differ from ``want``."""
    model, optim = stepped(ctx, seed=99)
    saver.load(step, model, optim)
    return differ(values(model, optim), want)


def add_method(out: Section, name: str, label: str, measured: str, got: dict[str, float]) -> None:
    """A method's row (checked: no tensor of its saves differs) and its numbers in ms."""
    wrong = int(got["wrong"])
    out.rows.append((label, measured, out.check(label, not wrong, f"{wrong} tensor(s) differ")))
    out.result[name] = {k: round(v * 1e3, 2) for k, v in got.items() if k != "wrong"}
    out.result[name]["wrong"] = wrong


# --------------------------------------------------------------------------- staging


def copy_limit_s(ctx: Ctx, tensors: list[torch.Tensor]) -> float:
    """The device's limit: the state copied into host memory already allocated (pinned
    on CUDA), non-blocking, synchronised once; best of 3."""
    into = [torch.empty(t.shape, dtype=t.dtype, pin_memory=ctx.cuda) for t in tensors]
    best = float("inf")
    for _ in range(4):  # the first touches the pages
        sync(ctx)
        start = time.perf_counter()
        for dst, src in zip(into, tensors, strict=True):
            dst.copy_(src, non_blocking=ctx.cuda)
        sync(ctx)
        best = min(best, time.perf_counter() - start)
    return best


def stage_runs(ctx: Ctx, name: str, model: nn.Module, optim: Any) -> dict[str, float]:
    """`REPEATS` saves after a step each: how long the call blocks, until the copy is in
    host memory, until durable; the last one restored and compared."""
    saver = Saver(name, ctx.work / name, model, optim, ctx.cuda)
    saver.prepare()
    saver.save(0)  # untimed: buffers allocated (and pinned) once
    saver.staged()
    saver.pending()
    times: dict[str, list[float]] = {"block": [], "staged": [], "durable": []}
    want: list[torch.Tensor] = []
    for rep in range(1, REPEATS + 1):
        train_step(model, optim, ctx.batch, plain)
        sync(ctx)
        want = values(model, optim)
        sync(ctx)
        start = time.perf_counter()
        saver.save(rep)
        times["block"].append(time.perf_counter() - start)
        saver.staged()
        times["staged"].append(time.perf_counter() - start)
        saver.pending()
        times["durable"].append(time.perf_counter() - start)
    wrong = wrong_after_load(ctx, saver, REPEATS, want)
    saver.close()
    return {k: statistics.median(v) for k, v in times.items()} | {"wrong": wrong}


def staging(ctx: Ctx) -> Section:
    """unbroken's staging (one reused arena, pinned on CUDA, copies on a side stream)
    against DCP's DefaultStager (pinned, non-blocking), on the same model."""
    out = Section()
    model, optim = stepped(ctx, seed=0)
    state = values(model, optim)
    nbytes = sum(t.nbytes for t in state)
    limit = copy_limit_s(ctx, state)
    pinned = "pinned " if ctx.cuda else ""
    out.rows.append(
        (
            f"{pinned}host copy of {nbytes / MIB:.0f} MiB (the limit)",
            f"{ms(limit)}, {rate(nbytes, limit)}",
            "-",
        )
    )
    out.result = {"nbytes": nbytes, "limit_ms": round(limit * 1e3, 2)}
    labels = {
        "unbroken_copy": "unbroken save, arena + side stream",
        "dcp": "DCP async_save + DefaultStager",
    }
    for name, label in labels.items():
        got = stage_runs(ctx, name, model, optim)
        measured = (
            f"blocks {ms(got['block'])}, staged {ms(got['staged'])} "
            f"({rate(nbytes, got['staged'])}), durable {ms(got['durable'])}"
        )
        add_method(out, name, label, measured, got)
    return out


# --------------------------------------------------------------------------- overlap


def steps_s(ctx: Ctx, model: nn.Module, optim: Any, guard: Guard) -> float:
    sync(ctx)
    start = time.perf_counter()
    for _ in range(AFTER):
        train_step(model, optim, ctx.batch, guard)
    sync(ctx)
    return time.perf_counter() - start


def overlap_runs(ctx: Ctx, name: str) -> dict[str, float]:
    """`REPEATS` saves, each followed by `AFTER` steps: what the save cost the loop (the
    call and the steps, less the same steps without a save); every save restored."""
    model, optim = stepped(ctx, seed=0)
    saver = Saver(name, ctx.work / f"overlap-{name}", model, optim, ctx.cuda)
    saver.prepare()
    saver.save(0)  # untimed: buffers allocated (and pinned) once
    train_step(model, optim, ctx.batch, saver.guard)
    saver.pending()
    base = min(steps_s(ctx, model, optim, saver.guard) for _ in range(3))
    blocks, costs, wants = [], [], {}
    for n in range(1, REPEATS + 1):
        sync(ctx)
        wants[n] = values(model, optim)
        sync(ctx)
        start = time.perf_counter()
        saver.save(n)
        blocks.append(time.perf_counter() - start)
        for _ in range(AFTER):
            train_step(model, optim, ctx.batch, saver.guard)
        sync(ctx)
        costs.append(time.perf_counter() - start - base)
        saver.pending()
    wrong = sum(wrong_after_load(ctx, saver, n, want) for n, want in wants.items())
    saver.close()
    return {
        "block": statistics.median(blocks),
        "cost": statistics.median(costs),
        "step": base / AFTER,
        "wrong": wrong,
    }


def overlap(ctx: Ctx) -> Section:
    """The overlapped capture (copies beside the next forward and backward) against the
    same save copied before it returns and against DCP, on a training loop."""
    out = Section()
    labels = {
        "unbroken": "unbroken, overlapped",
        "unbroken_copy": "unbroken, overlap=False",
        "dcp": "DCP + DefaultStager, staging waited before step",
    }
    for name, label in labels.items():
        got = overlap_runs(ctx, name)
        measured = (
            f"blocks {ms(got['block'])}, costs the loop {ms(got['cost'])} (step {ms(got['step'])})"
        )
        add_method(out, name, label, measured, got)
    return out
