"""A tiny character-level GPT and the data it trains on.

Everything here is deterministic given a seed, and small enough to train for a few dozen
steps on two CPU cores in about a second: the point of the demo is exact resumption, not
the quality of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def load_corpus() -> str:
    """The demo's training text, shipped with the package."""
    return (resources.files("unbroken.demo") / "corpus.txt").read_text(encoding="utf-8")


class CharVocab:
    """Maps each distinct character of a text to an id (sorted, so ids are stable)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._ids[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    mask: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        # Explicit dropout modules (rather than SDPA's dropout_p) so every random draw
        # comes from torch's global CPU generator, which RNGState saves and restores.
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        # Not persistent: it is derived from the config, so it need not be checkpointed.
        self.register_buffer("mask", mask[None, None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.n_layer)))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of predicting ``targets`` (``idx`` shifted by one)."""
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ShardedBatches:
    """Random windows of a token stream, split between ranks like ``DistributedSampler``.

    Each epoch is a fixed permutation of window start positions (seeded by ``seed`` and
    the epoch, never by the global RNG). Global batch ``i`` of an epoch is cut into
    ``world`` slices and rank ``r`` takes slice ``r``, so ranks never see the same window
    in an epoch. The position (epoch, batch) is the whole state: saving it with
    ``state_dict`` and loading it on resume picks up at the very next batch.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        block_size: int,
        batch_size: int,
        rank: int,
        world: int,
        seed: int,
        stride: int = 16,
    ) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.rank = rank
        self.world = world
        self.seed = seed
        self.starts = torch.arange(0, len(tokens) - block_size - 1, stride)
        self.batches_per_epoch = len(self.starts) // (batch_size * world)
        if self.batches_per_epoch == 0:
            raise ValueError(f"{len(tokens)} tokens are too few for one global batch")
        self.epoch = 0
        self.batch = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` for the next batch; advances the position."""
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        order = torch.randperm(
            len(self.starts), generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        first = (self.batch * self.world + self.rank) * self.batch_size
        starts = self.starts[order[first : first + self.batch_size]]
        windows = torch.stack([self.tokens[s : s + self.block_size + 1] for s in starts.tolist()])
        self.batch += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.batch = int(state_dict["batch"])
