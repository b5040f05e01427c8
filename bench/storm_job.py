"""The job of bench/storm.py, the same for every method: a transformers Llama with a tiny
config built in code (no download), its data through ``unbroken.data``, the event log
every process writes and the digest of the final parameters.

Events are JSON lines in ``--out/events-<rank>-<pid>.jsonl`` with a wall-clock ``t``:
``start`` (a process began), ``restored`` (the step it resumed from; 0 for a fresh start),
``step`` (a step completed: its loss and the seconds its checkpoint calls took) and
``final`` (the digest of the parameters at the last step). A ``rank`` is a data-parallel
rank (under torchft: a replica group). Each process also writes its pid to
``--out/pids/rank-<rank>``: bench/storm_faults.py finds its targets there.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from unbroken.data import ResumableSampler, TokenDataset
from unbroken.data.files import sidecar
from unbroken.demo.model import tokenise_corpus

SEQ = 64
BATCH = 4  # sequences per rank and step
VOCAB = 257  # unbroken.data.ByteTokenizer


def build_model() -> nn.Module:
    """The Llama, initialised from seed 0 (every method starts from the same values)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4)


def sampler(out: str, rank: int, world: int) -> tuple[TokenDataset, ResumableSampler]:
    """The shipped corpus, tokenised once into ``out`` and memory-mapped by every
    process, in the order of a ResumableSampler (its state is checkpointed with the
    model where the method allows)."""
    path = os.path.join(out, "tokens.bin")
    lock = path + ".lock"
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
        if not os.path.exists(sidecar(path)):
            tokenise_corpus(Path(path))
    except FileExistsError:
        while not os.path.exists(sidecar(path)):
            time.sleep(0.05)
    dataset = TokenDataset([path] * 16, seq_len=SEQ)
    return dataset, ResumableSampler(dataset, BATCH, seed=0, rank=rank, world_size=world)


def batches(dataset: TokenDataset, order: ResumableSampler) -> Iterator[torch.Tensor]:
    while True:
        for indices in order:
            yield torch.stack([dataset[i] for i in indices]).long()


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=tokens, labels=tokens).loss
    return loss


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class Events:
    """This process's event log, and its pid where the fault driver finds it."""

    def __init__(self, out: str, rank: int, node: int | None = None) -> None:
        self.out, self.rank, self.node = out, rank, node
        self.path = os.path.join(out, f"events-{rank}-{os.getpid()}.jsonl")
        pids = Path(out) / "pids"
        pids.mkdir(exist_ok=True)
        tmp = pids / f".rank-{rank}-{os.getpid()}"
        tmp.write_text(str(os.getpid()))
        tmp.replace(pids / f"rank-{rank}")
        self.stepped = False
        self("start")

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": time.time(), "rank": self.rank, "pid": os.getpid()}
        with open(self.path, "a") as f:
            f.write(json.dumps(record | {"node": self.node, **fields}) + "\n")
        # Markers the driver polls cheaply: the job's first step, its end.
        if event == "step" and not self.stepped:
            self.stepped = True
            Path(self.out, "stepped").touch()
        elif event == "final":
            Path(self.out, "final").touch()
            Path(self.out, f"final-{self.rank}").touch()
