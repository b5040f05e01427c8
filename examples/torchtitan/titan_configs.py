"""torchtitan configs (its ``--module``/``--config`` registry) checkpointed by unbroken.

``llama3_debug_unbroken``: torchtitan's llama3 ``debugmodel`` (6 layers, dim 256, vocab
2048) with `unbroken.torchtitan.CheckpointManager` in place of DCP, sized to train on
CPU with gloo in seconds. What differs from ``llama3_debugmodel`` and why:

- checkpoint: unbroken's manager (every step a heal record and a snapshot in memory,
  every 4 steps a background save, the newest 3 kept);
- data and tokenizer: synthetic tokens from a seeded generator per rank and sample, and
  a byte tokenizer, so nothing is downloaded (torchtitan's c4_test and tokenizer files
  live in its git repository, not in its wheel);
- attention: SDPA, causal (torchtitan's flex attention has no backward on CPU in torch
  2.13); each sample is one document, so causal masking is the document mask;
- FSDP reduces with SUM (gloo has no PREMUL_SUM, which torchtitan's gradient scaling
  asks FSDP for), ``partial_dtensor`` (the ``spmd_types`` default needs CUDA here),
  float32 parameters, no activation checkpointing, no validation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from unbroken.torchtitan import CheckpointManager

VOCAB = 2048  # the debug model's


class ByteTokenizer(BaseTokenizer):
    """Bytes as tokens: nothing to download (the synthetic data does not use it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str = "") -> None:
        super().__init__()
        self.eos_id = 0

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        return list(str(args[0]).encode())

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return bytes(args[0]).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return VOCAB


class SyntheticTokens(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """Sample ``i`` of data-parallel rank ``r``: tokens from a generator seeded by both,
    so that a resumed run reads exactly what an uninterrupted one reads."""

    def __init__(self, seq_len: int, dp_rank: int) -> None:
        self.seq_len, self.dp_rank, self.index = seq_len, dp_rank, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(self.dp_rank * 1_000_003 + self.index)
            tokens = torch.randint(0, VOCAB, (self.seq_len + 1,), generator=g)
            self.index += 1
            yield {"input": tokens[:-1], "positions": torch.arange(self.seq_len)}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


class SyntheticDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        pass

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            SyntheticTokens(seq_len, dp_rank),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )


def _sum_on_gloo(parallelize: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def parallelize_for_gloo(model: nn.Module, **kwargs: Any) -> nn.Module:
        model = parallelize(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize_for_gloo


def llama3_debug_unbroken() -> Trainer.Config:
    config = llama3_debugmodel()
    config.checkpoint = CheckpointManager.Config(
        interval=4, keep_latest_k=3, snapshot_interval=1, last_save_model_only=False
    )
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = SyntheticDataLoader.Config()
    training = config.training
    training.local_batch_size, training.seq_len, training.steps = 2, 64, 8
    training.mixed_precision_param = "float32"
    training.disable_cuda_graphs = True
    config.validator.enable = False
    config.debug.seed = 0  # the same initial weights in every run, to compare runs
    config.activation_checkpoint = None
    config.parallelism.spmd_backend = "partial_dtensor"
    spec = config.model_spec
    assert spec is not None
    spec.parallelize_fn = _sum_on_gloo(spec.parallelize_fn)
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config
