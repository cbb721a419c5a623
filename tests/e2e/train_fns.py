"""Training functions the end-to-end tests hand to Ray Train (importable by workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import ray_fsdp_backend as rfb
from tests.models import make_batch, reference_model


def full_params(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def train_toy(loop_config: dict) -> dict:
    """A few SGD steps of ToyNet on this rank's slice of the batch; returns the
    trained parameters and where this rank sat in the mesh (all ranks')."""
    ctx = rfb.get_context()
    model = ctx.wrap(reference_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_batch(loop_config.get("batch", 16))
    per = x.shape[0] // ctx.dp_size
    x, y = (
        x[ctx.dp_rank * per : (ctx.dp_rank + 1) * per],
        y[ctx.dp_rank * per : (ctx.dp_rank + 1) * per],
    )
    for _ in range(loop_config["steps"]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        ctx.clip_grad_norm(model, 1e3, optimizer=opt)
        opt.step()
    import ray

    me = {
        "rank": ctx.world_rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "groups": {
            axis: dist.get_process_group_ranks(ctx.mesh.get_group(axis))
            for axis in ctx.mesh.mesh_dim_names
        },
    }
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, me)
    # Ray refuses tensors in return values: send plain lists.
    params = {n: p.tolist() for n, p in full_params(model).items()}
    return {"params": params, "ranks": everyone, "strategy": type(ctx.strategy).__name__}


def reference_toy(steps: int, batch: int = 16) -> dict[str, torch.Tensor]:
    model = reference_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_batch(batch)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return full_params(model)
