"""The loss rule on real gloo ranks against one process (docs/long-context.md).

One spawned job on 4 ranks builds the context the backend builds for each
layout and runs the documented loops on the project's decoder, rows holding
-100 targets unevenly (some rows none valid, one rank's share much emptier):

- the token-exact loop (each micro-batch's token sum over
  ``ctx.global_token_count`` of the whole step's labels, 2 micro-batches
  accumulated under ``no_sync``) gives the gradient of the mean over every
  valid token of the step, and the mean of the ranks' losses that mean, at
  FSDP dp 4, HSDP 2 x 2, dp_shard 2 x cp 2, dp 2 x tp 2 (cp 1) and DDP dp 4;
- the per-rank mean loop (``loss.backward()`` on each rank's mean) keeps
  giving the average of the dp ranks' gradients under FSDP and DDP.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_fsdp_backend import TrainContext
from ray_fsdp_backend.context_parallel import shard_sequence
from ray_fsdp_backend.context_parallel.sequence import default_position_ids
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks

SEQ, ROWS, MICRO = 16, 8, 2  # ROWS global rows per micro-batch

LAYOUTS = {
    "fsdp dp4": dict(),
    "hsdp 2x2": dict(fsdp_sharding_strategy="hybrid_shard", fsdp_hsdp_replicate_size=2),
    "dp_shard2 x cp2": dict(context_parallel_size=2),
    "dp2 x tp2": dict(tensor_parallel_size=2),
    "ddp dp4": dict(use_fsdp=False),
}


def _decoder() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=SEQ))


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    """MICRO micro-batches of ROWS rows; row i ignores its first 3i targets
    mod SEQ+2 (rows 5 and 13 hold none valid at all)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (MICRO * ROWS, SEQ), generator=g)
    labels = ids.clone()
    for i in range(len(labels)):
        labels[i, : (3 * i) % (SEQ + 2)] = -100
    positions = default_position_ids(MICRO * ROWS, SEQ)
    rows = {"input_ids": ids, "labels": labels, "position_ids": positions}
    return [{k: v[m * ROWS : (m + 1) * ROWS] for k, v in rows.items()} for m in range(MICRO)]


def _token_sum(model, batch) -> torch.Tensor:
    logits = model(batch["input_ids"], position_ids=batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")


def _full_grads(model) -> list[torch.Tensor]:
    grads = []
    for p in model.parameters():
        g = p.grad
        grads.append(g.full_tensor() if hasattr(g, "full_tensor") else g.clone())
    return grads


def _reference_token_exact() -> tuple[float, list[torch.Tensor]]:
    """One process: the mean over every valid target of the whole step."""
    model = _decoder()
    whole = shard_sequence(
        {
            k: torch.cat([m[k] for m in _micro_batches()])
            for k in ("input_ids", "labels", "position_ids")
        },
        0,
        1,
    )
    loss = _token_sum(model, whole) / (whole["labels"] != -100).sum()
    loss.backward()
    return float(loss), [p.grad for p in model.parameters()]


def _mine(ctx: TrainContext, rows: dict) -> dict:
    per = ROWS // ctx.dp_size
    return ctx.shard_sequence(
        {k: v[ctx.dp_rank * per : (ctx.dp_rank + 1) * per] for k, v in rows.items()}
    )


def _token_exact(ctx: TrainContext) -> tuple[float, list[torch.Tensor]]:
    """The documented loop: one count for the step, micro-batches under no_sync."""
    model = ctx.wrap(_decoder())
    batches = [_mine(ctx, rows) for rows in _micro_batches()]
    count = ctx.global_token_count([b["labels"] for b in batches])
    total = torch.zeros(())
    for i, batch in enumerate(batches):
        sync = ctx.no_sync(model) if i < MICRO - 1 else torch.enable_grad()
        with sync, ctx.sequence_region(), ctx.loss_parallel():
            loss = _token_sum(model, batch) / count
            loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    return float(total) / ctx.world_size, _full_grads(model)


def _per_rank_mean(ctx: TrainContext | None) -> list[torch.Tensor]:
    """Each rank's mean loss, one micro-batch; ctx None: one process
    averaging the dp ranks' mean losses."""
    rows = _micro_batches()[0]
    if ctx is None:
        model = _decoder()
        per = ROWS // 4
        losses = []
        for r in range(4):
            b = shard_sequence({k: v[r * per : (r + 1) * per] for k, v in rows.items()}, 0, 1)
            losses.append(_token_sum(model, b) / (b["labels"] != -100).sum())
        (sum(losses) / 4).backward()
        return [p.grad for p in model.parameters()]
    model = ctx.wrap(_decoder())
    batch = _mine(ctx, rows)
    (_token_sum(model, batch) / (batch["labels"] != -100).sum()).backward()
    return _full_grads(model)


def _relative(grads, ref) -> float:
    return max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, ref, strict=True))


def _checks(rank, world):
    ref_loss, ref_grads = _reference_token_exact()
    mean_ref = _per_rank_mean(None)
    results = {}
    for name, extra in LAYOUTS.items():
        settings = {"use_fsdp": True, "use_mixed_precision": False, **extra}
        ctx = setup_process_context(FSDPSettings(**settings), torch.device("cpu"))
        loss, grads = _token_exact(ctx)
        results[("token", name)] = (abs(loss - ref_loss) / ref_loss, _relative(grads, ref_grads))
        if ctx.cp_size == 1 and ctx.tp_size == 1:
            results[("mean", name)] = _relative(_per_rank_mean(ctx), mean_ref)
    # The rows really are uneven: per-rank means differ from the token mean.
    results["spread"] = _relative(mean_ref, ref_grads)
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(_checks, 4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_exact_loop_is_the_global_token_mean(results, layout):
    loss_error, grad_error = results[("token", layout)]
    assert loss_error < 1e-5 and grad_error < 1e-5, (loss_error, grad_error)


@pytest.mark.parametrize("layout", ["fsdp dp4", "hsdp 2x2", "ddp dp4"])
def test_per_rank_mean_loop_averages_the_ranks_gradients(results, layout):
    assert results[("mean", layout)] < 1e-5


def test_the_rows_tell_the_two_rules_apart(results):
    assert results["spread"] > 1e-2  # so each check above can fail
