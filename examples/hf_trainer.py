"""transformers' ``Trainer`` saving to and resuming from unbroken: a tiny Llama, DDP over
2 ranks on CPU. Killed at step 10, the job resumes mid-epoch and ends with the parameters
an uninterrupted run ends with, bit for bit. Restarting every rank, it resumes from the
newest save (step 8):

    unbroken run --nproc-per-node 2 --max-restarts 1 --inject-fault "kill rank=1 step=10" \\
        examples/hf_trainer.py --dir runs/hf_trainer

In-process, only the killed rank starts again; it takes the step the others hold (their
live replicas) and the steps the others trained are not trained again:

    unbroken run --in-process --simulate-nodes 2 --nproc-per-node 1 --max-restarts 1 \\
        --inject-fault "kill rank=1 step=10" examples/hf_trainer.py --dir runs/hf_inproc
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

import unbroken
import unbroken.run
from unbroken.hf.trainer import Checkpointing


class UnbrokenTrainer(Checkpointing, Trainer):
    """The Trainer, its checkpoints through unbroken."""


parser = argparse.ArgumentParser(description="the Hugging Face Trainer through unbroken")
parser.add_argument("--dir", default="runs/hf_trainer", help="checkpoint directory")
parser.add_argument("--steps", type=int, default=16, help="train up to this step")
parser.add_argument("--save-every", type=int, default=4)
args = parser.parse_args()

# Built once per process, so that healthy ranks keep them across a failure in-process.
config = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.1,
)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
scheduler = get_linear_schedule_with_warmup(optimizer, 2, args.steps)
tokens = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": t, "labels": t} for t in tokens]


def train() -> None:
    """One generation: the Trainer and the checkpointer hold its process group."""
    training = TrainingArguments(
        output_dir=os.path.join(args.dir, "trainer"), use_cpu=True, ddp_backend="gloo",
        max_steps=args.steps, per_device_train_batch_size=2, save_strategy="steps",
        save_steps=args.save_every, seed=0, logging_steps=1, report_to="none",
        disable_tqdm=True,
    )  # fmt: skip
    ckpt = unbroken.Checkpointer(args.dir, keep=2, memory=True, replicas=1)
    trainer = UnbrokenTrainer(
        model=model, args=training, train_dataset=data, optimizers=(optimizer, scheduler),
        checkpointer=ckpt,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=True)  # the newest step, if any; else from scratch
    ckpt.close()
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    logged = hashlib.sha256(json.dumps(losses).encode()).hexdigest()[:16]
    if training.process_index == 0:
        print(
            f"finished at step {trainer.state.global_step}, parameters {digest.hexdigest()[:16]}, "
            f"{len(losses)} losses logged {logged}"
        )


unbroken.run.in_process(train)  # initialises the process group; reruns train() after a fault
