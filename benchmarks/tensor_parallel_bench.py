"""Comparison 11: tensor parallel tp 2 x dp 2 vs FSDP2 dp 4, same global batch.

**A (tp2 x dp2)**: ``FSDPConfig(tensor_parallel_size=2)`` on 4 ranks, mesh
``(dp_shard=2, tp=2)``, sequence parallel on: each dp shard reads half the
global batch, the two ranks of a tp group the same half. **B (dp4)**:
``full_shard`` on 4 ranks, each reading a quarter. Same decoder, weights and
global batch; the first step's global losses are compared (``same_loss``,
fp32). Step time alternates A and B; memory is the model state one rank
holds (parameters, gradients, AdamW moments, max over ranks) and the
activation estimate of ``ray-fsdp plan`` for one micro-batch.

**TP traffic before / after** (issue 37): the same tp 2 x dp 2 run with the
column-wise layers fed plain tensors, as before torchtitan's layout was
adopted (each then all-reduces its own input gradient: q, k, v, gate, up),
against the shipped layout (one reduction per attention and per MLP), with
sequence parallelism on and off; all five runs alternate. Bytes per step are
what one rank sends over its tp group in one step (ring, every collective:
blocks, embedding, head and clip), recorded by a dispatch mode;
the plan's per-block estimate stands beside them.

On CPU with gloo, TP adds per-layer collectives (all-gather and
reduce-scatter of the activations) that FSDP does not have, and halves the
matmul work per rank only where the batch is not already split: expect TP to
be slower here. It pays where a model's layers or activations do not fit one
device, inside a node's fast links.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from benchmarks import _measure, _workload
from benchmarks._collectives import CollectiveLog
from ray_fsdp_backend import FSDPSettings, build_strategy
from ray_fsdp_backend.distributed.mesh import build_device_mesh, resolve_layout
from ray_fsdp_backend.models.decoder import ModelConfig
from ray_fsdp_backend.planning.memory import estimate_activations, estimate_tp_block_traffic
from ray_fsdp_backend.planning.topology import topology_from_node_counts

CPU = torch.device("cpu")
# name: (tensor_parallel_size, sequence_parallel, column-wise inputs plain as before)
RUNS = {
    "tp2_dp2": (2, True, False),
    "dp4": (1, None, False),
    "tp2_dp2_before": (2, True, True),
    "tp2_dp2_no_sp": (2, False, False),
    "tp2_dp2_no_sp_before": (2, False, True),
}
TRAFFIC = {"sp": ("tp2_dp2", "tp2_dp2_before"), "no_sp": ("tp2_dp2_no_sp", "tp2_dp2_no_sp_before")}


def _global_batch(model: dict, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ModelConfig(**model)
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _setup(rank: int, world: int, run: tuple, model: dict, batch: int):
    tp, sp, before = run
    cfg = FSDPSettings(
        use_fsdp=True, use_mixed_precision=False, tensor_parallel_size=tp, sequence_parallel=sp
    )
    layout = resolve_layout(cfg, topology_from_node_counts([world]))
    mesh = build_device_mesh(layout, "cpu")
    strategy = build_strategy(cfg, device=CPU, local_rank=rank, mesh=mesh)
    wrapped = strategy.wrap(_workload.build_model(model))
    if before:
        _feed_plain_inputs(wrapped)
    dp_rank, dp_size = layout.data_parallel_coordinates(rank)
    x, y = _global_batch(model, batch)
    rows = slice(dp_rank * batch // dp_size, (dp_rank + 1) * batch // dp_size)
    return strategy, wrapped, _workload.make_optimizer(wrapped), [(x[rows], y[rows])], cfg


def _feed_plain_inputs(model: nn.Module) -> None:
    """Every linear takes a plain tensor, as before issue 37: a column-wise
    layer then declares it replicated and all-reduces its own input
    gradient (prepended, so the hook runs before the TP style's own)."""

    def plain(_module, args):
        return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(plain, prepend=True)


def _step(strategy, model, opt, batches) -> float:
    opt.zero_grad()
    for x, y in batches:
        with strategy.loss_parallel():
            loss = _workload.loss_fn(model, x, y)
            loss.backward()
    strategy.clip_grad_norm(model, _workload.MAX_NORM, optimizer=opt)
    opt.step()
    return float(loss.detach())


def _global_loss(local: float, world: int) -> float:
    t = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(t)  # a tp group's ranks hold their dp shard's loss alike
    return float(t) / world


def _activation_bytes(model: dict, rows: int, cfg: FSDPSettings) -> int:
    return estimate_activations(
        ModelConfig(**model).activation_shape(rows),
        tp=cfg.tensor_parallel_size,
        sequence_parallel=cfg.sequence_parallel_enabled,
        loss_parallel=cfg.loss_parallel,
    )


def _logged_step(run: tuple, world: int) -> tuple[float, float]:
    """One more step: the bytes this rank sends over its tp group (max over
    ranks) and the global loss."""
    strategy = run[0]
    with CollectiveLog() as log:
        loss = _step(*run[:4])
    tp_ranks = tuple(dist.get_process_group_ranks(strategy.tp_mesh.get_group()))
    sent = _measure.max_over_ranks([float(log.sent("ranks")[tp_ranks])])[0]
    return sent, _global_loss(loss, world)


def _block_estimate(model: dict, rows: int, cfg: FSDPSettings) -> int:
    return estimate_tp_block_traffic(
        ModelConfig(**model).activation_shape(rows),
        tp=cfg.tensor_parallel_size,
        sequence_parallel=cfg.sequence_parallel_enabled,
    ).sent


def _traffic(runs: dict, times: dict, model: dict, world: int) -> dict:
    """Before / after for each sequence-parallel setting, after the timed
    steps (as many for every run): bytes of one more step, and whether its
    loss is the same both ways."""
    out = {}
    for key, (after, before) in TRAFFIC.items():
        (sent_after, loss_after), (sent_before, loss_before) = (
            _logged_step(runs[name], world) for name in (after, before)
        )
        _, _, _, batches, cfg = runs[after]
        out[key] = {
            "time": _measure.compare(times[after], times[before]),
            "bytes_per_step": {"after": sent_after, "before": sent_before},
            "block_estimate": _block_estimate(model, len(batches[0][0]), cfg),
            "same_loss": abs(loss_after - loss_before) <= 1e-5 * abs(loss_before),
        }
    return out


def on_rank(rank: int, world: int, *, model: dict, batch: int, reps: int, steps: int) -> dict:
    runs, first, memory = {}, {}, {}
    for name, run in RUNS.items():
        strategy, wrapped, opt, batches, cfg = _setup(rank, world, run, model, batch)
        first[name] = _global_loss(_step(strategy, wrapped, opt, batches), world)
        if name in ("tp2_dp2", "dp4"):
            memory[name] = {
                **_measure.state_bytes(wrapped, opt),
                "activations_estimate": _activation_bytes(model, len(batches[0][0]), cfg),
            }
        runs[name] = (strategy, wrapped, opt, batches, cfg)
    times = _measure.alternate(
        {name: (lambda r=r: _step(*r[:4])) for name, r in runs.items()}, reps=reps, steps=steps
    )
    same = abs(first["tp2_dp2"] - first["dp4"]) <= 1e-5 * abs(first["dp4"])
    return {
        "world_size": world,
        "model": model,
        "global_batch": batch,
        "time": _measure.compare(times["tp2_dp2"], times["dp4"]),
        "memory": memory,
        "same_loss": same,
        "traffic": _traffic(runs, times, model, world),
    }
