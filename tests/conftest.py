from __future__ import annotations

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 4))


def train_steps(model: nn.Module, optim: torch.optim.Optimizer, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(torch.randn(5, 8)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses
