"""PyTorch Lightning with unbroken's CheckpointIO: ModelCheckpoint keeps the two best
epochs by validation loss and ``last.ckpt``; run it again and it resumes from
``last.ckpt``. Prints a digest of the final weights, so runs can be compared.

    python examples/lightning.py --dir runs/lit --epochs 2
    python examples/lightning.py --dir runs/lit --epochs 4   # resumes after epoch 2
    python examples/lightning.py --dir runs/lit-ddp --devices 2  # DDP, 2 CPU processes
    unbroken show runs/lit/last.ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unbroken.lightning import CheckpointIO


class Regression(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()  # stored as JSON in the checkpoint
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optim = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)
        return {"optimizer": optim, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optim, 2)}


def loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=8)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description="Lightning + unbroken, resume on rerun")
    parser.add_argument("--dir", default="runs/lit", help="checkpoint directory")
    parser.add_argument("--epochs", type=int, default=4, help="train up to this epoch")
    parser.add_argument("--devices", type=int, default=1, help=">1: DDP on CPU processes")
    parser.add_argument("--async-save", action="store_true", help="write in the background")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    model = Regression()
    checkpoint_io = CheckpointIO(async_save=args.async_save)  # local paths or s3://
    best = ModelCheckpoint(
        dirpath=args.dir, monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        plugins=[checkpoint_io],
        callbacks=[best],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = os.path.join(args.dir, "last.ckpt")
    resume = last if checkpoint_io.exists(last) else None
    trainer.fit(model, loader(0), loader(1), ckpt_path=resume)
    if trainer.is_global_zero:
        print(f"resumed from {resume}" if resume else "started fresh", flush=True)
        print(f"finished at epoch {trainer.current_epoch}, weights {digest(model)}", flush=True)


if __name__ == "__main__":
    main()
