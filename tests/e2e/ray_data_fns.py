"""Worker side of the Ray Data mesh test: the trainer's own ``ray_data``
source (``RayDataBatches`` on ``ray.train.get_dataset_shard("train")``) and
its ``train_step``, with the row ids every rank read recorded.

Row ``i`` of the dataset is ``ROW_LEN`` tokens seeded by ``i`` whose first
token is ``i`` itself, so a rank's inputs name the rows it read.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.distributed as dist

import ray_fsdp_backend as rfb
from ray_fsdp_backend.runtime.worker import describe_datasets
from ray_fsdp_backend.trainer.loop.train import setup_run, train_step
from ray_fsdp_backend.trainer.schema.spec import build_spec

MODEL = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)
ROWS, MICRO, EPOCHS = 8, 2, 2  # 2 steps an epoch at dp 2 (issue 45: was 24 rows, 6)
ROW_LEN = MODEL["seq_len"] + 1


def row(i: int) -> np.ndarray:
    g = torch.Generator().manual_seed(1000 + i)
    tokens = torch.randint(0, MODEL["vocab_size"], (ROW_LEN,), generator=g)
    tokens[0] = i
    return tokens.numpy()


def spec_doc(tp: int, cp: int, steps: int) -> dict:
    return {
        "distributed": {"use_fsdp": True, "use_mixed_precision": False,
                        "tensor_parallel_size": tp, "context_parallel_size": cp},
        "model": MODEL,
        "train": {"steps": steps, "micro_batch_size": MICRO, "lr": 3e-3, "warmup_steps": 0,
                  "min_lr_ratio": 1.0, "max_grad_norm": 0.05, "log_every": 1},
        "data": {"source": "ray_data", "path": "rows-built-by-the-test"},
        "scaling": {"num_workers": 4, "use_gpu": False},
    }  # fmt: skip


class RecordedBatches:
    """The trainer's batches, with the row ids of every micro-batch kept."""

    def __init__(self, inner) -> None:
        self.inner, self.ids = inner, []

    def next_batch(self):
        batch = self.inner.next_batch()
        self.ids.append([int(i) for i in batch[0][:, 0]])
        return batch


def train_ray_data(loop_config: dict) -> None:
    ctx = rfb.get_context()
    spec = build_spec(loop_config["spec"])
    run = setup_run(ctx, spec, resume=False)
    ctx.load_pretrained(run.model, loop_config["init"])
    batches = RecordedBatches(run.batches)
    losses, norms = [], []
    for _ in range(spec.train.steps):
        result = train_step(ctx, run.model, run.optimizer, batches, spec)
        loss = result.loss.detach().clone()
        dist.all_reduce(loss)  # the mean over the global batch (equal rows per rank)
        losses.append(float(loss) / ctx.world_size)
        norms.append(float(result.grad_norm))
    axis = "tp" if "tp" in ctx.mesh.mesh_dim_names else "cp"  # the group that reads alike
    group = dist.get_process_group_ranks(ctx.mesh[axis].get_group())
    record = {"dp_rank": ctx.dp_rank, "dp_size": ctx.dp_size, "ids": batches.ids, "group": group,
              "losses": losses, "norms": norms, "datasets": describe_datasets()}  # fmt: skip
    with open(os.path.join(loop_config["out"], f"rank_{ctx.world_rank}.json"), "w") as f:
        json.dump(record, f)
