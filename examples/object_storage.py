"""Checkpoints in S3 or any S3-compatible store (MinIO, Ceph RGW...) reached through an
endpoint. Bucket and prefix come from ``--url``; credentials from the arguments or, when
left out, from the usual AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``~/.aws``, SSO, instance roles). Needs ``pip install 'unbroken[s3]'``.

The bucket must exist: unbroken creates objects, never buckets. Create it once with your
store's tool, e.g. ``aws s3 mb s3://bucket --endpoint-url http://127.0.0.1:9000`` or
MinIO's ``mc mb local/bucket``; a missing bucket is a one-line error.

    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...
    python examples/object_storage.py --url s3://bucket/runs/exp1 \\
        --endpoint http://127.0.0.1:9000 --steps 40
    unbroken ls s3://bucket/runs/exp1 --endpoint http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

import unbroken


def main() -> None:
    parser = argparse.ArgumentParser(description="checkpoint to an S3 endpoint")
    parser.add_argument("--url", required=True, help="s3://bucket/prefix")
    parser.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"))
    parser.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    parser.add_argument("--access-key-id", help="default: the AWS credential chain")
    parser.add_argument("--secret-access-key", help="default: the AWS credential chain")
    parser.add_argument("--steps", type=int, default=100, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()

    storage_options: dict[str, Any] = {
        "endpoint": args.endpoint,  # None: AWS itself
        "region": args.region,
        "path_style": args.endpoint is not None,  # http://host/bucket/key, as MinIO and RGW serve
        "access_key_id": args.access_key_id,  # None: the AWS chain
        "secret_access_key": args.secret_access_key,
    }

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = unbroken.Progress(step=0)
    state = {"model": model, "optim": optimizer, "rng": unbroken.RNGState(), "progress": progress}

    with unbroken.Checkpointer(args.url, storage_options=storage_options, keep=3) as ckpt:
        step = ckpt.restore(state) or 0  # finds the newest step through `latest`, no LIST
        print(f"resumed from step {step}" if step else "starting at step 0", flush=True)
        while step < args.steps:
            x = torch.randn(32, 16)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step = progress.step = progress.step + 1
            if step % args.save_every == 0:
                ckpt.save(step, state, blocking=False)  # uploads while training goes on
                print(f"step {step}: loss {loss.item():.4f}, saving", flush=True)
        ckpt.wait()  # every background save committed, or its failure raised
        print(f"committed in {args.url}: steps {ckpt.steps()}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except unbroken.CheckpointError as e:  # no bucket, no credentials, no server: say which
        raise SystemExit(f"error: {e}") from None
