"""Every strategy against a single-process reference, on real gloo ranks.

One spawned job per world size runs all checks for all strategies (a spawn
costs seconds here), the 2-rank one DDP's buffer broadcast too; each check
compares with the same model trained in one process on the full batch.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ray_fsdp_backend import FSDPConfig, build_strategy
from ray_fsdp_backend.strategies.blocks import materialize_meta_module
from tests.dist.harness import run_ranks
from tests.models import ToyNet, make_batch, reference_model

STRATEGIES = ["full_shard", "shard_grad_op", "hybrid_shard", "_hybrid_shard_zero2", "ddp"]
STEPS = 3
LR = 0.1


def _config(name: str, **overrides) -> FSDPConfig:
    if name == "ddp":
        return FSDPConfig(use_fsdp=False, use_mixed_precision=False, **overrides)
    return FSDPConfig(
        use_fsdp=True, fsdp_sharding_strategy=name, use_mixed_precision=False, **overrides
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _params(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)  # DDP
    return {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _grads(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {n: _full(p.grad).clone() for n, p in model.named_parameters()}


def _local_batch(x, y, rank, world):
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _train(model, batches, steps=STEPS, strategy=None, max_norm=None):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        x, y = batches
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if max_norm is not None:
            if strategy is None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            else:
                norms.append(strategy.clip_grad_norm(model, max_norm, optimizer=opt))
        opt.step()
        losses.append(loss.detach())
    return losses, norms


def _reference(steps=STEPS, max_norm=None, **model_kwargs):
    model = reference_model(**model_kwargs)
    _, norms = _train(model, make_batch(), steps=steps, max_norm=max_norm)
    return _params(model), norms


def _wrapped(name, rank, **overrides):
    model_kwargs = overrides.pop("model_kwargs", {})
    strategy = build_strategy(
        _config(name, **overrides), device=torch.device("cpu"), local_rank=rank
    )
    return strategy, strategy.wrap(reference_model(**model_kwargs))


def _assert_close(got: dict, want: dict, atol=1e-5, what=""):
    assert got.keys() == want.keys(), (what, got.keys(), want.keys())
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=f"{what}: {k}")


def check_training_matches_reference(name, rank, world):
    strategy, model = _wrapped(name, rank)
    _train(model, _local_batch(*make_batch(), rank, world), strategy=strategy)
    want, _ = _reference()
    _assert_close(_params(model), want, what=f"{name} params after {STEPS} steps")


def check_shard_fraction(name, rank, world):
    strategy, model = _wrapped(name, rank)
    local = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )
    total = sum(p.numel() for p in ToyNet().parameters())
    shard = strategy.mesh.size(-1) if strategy.params_sharded else 1
    # FSDP2 pads each parameter's dim 0 to a multiple of the shard size.
    assert total / shard - 64 <= local <= total / shard + 64, (name, local, total, shard)


def check_clipping(name, rank, world):
    want_params, want_norms = _reference(steps=2, max_norm=0.05)
    strategy, model = _wrapped(name, rank)
    _, norms = _train(
        model, _local_batch(*make_batch(), rank, world), steps=2, strategy=strategy, max_norm=0.05
    )
    for got, want in zip(norms, want_norms, strict=True):
        assert got.dim() == 0 and not isinstance(got, DTensor)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    clipped = torch.stack([g.norm() for g in _grads(model).values()]).norm()
    assert clipped <= 0.05 * (1 + 1e-4), (name, clipped)
    assert strategy.last_grad_clip_stats["clip_coef"] < 1.0
    _assert_close(_params(model), want_params, what=f"{name} clipped training")


def check_no_sync_accumulation(name, rank, world):
    modes = [{}] if name == "ddp" else [{}, {"fsdp_accumulate_unsharded": True}]
    for overrides in modes:
        _no_sync_accumulation(name, rank, world, **overrides)


def _no_sync_accumulation(name, rank, world, **overrides):
    strategy, model = _wrapped(name, rank, **overrides)
    x, y = _local_batch(*make_batch(), rank, world)
    half = x.shape[0] // 2
    with strategy.no_sync(model):
        (torch.nn.functional.mse_loss(model(x[:half]), y[:half]) / 2).backward()
    inner = getattr(model, "module", model)
    what = f"{name} {overrides or 'sharded'} no_sync accumulation"
    if overrides.get("fsdp_accumulate_unsharded"):
        # FSDP2 keeps unsynced gradients unsharded, off `.grad`, until a synced backward.
        assert all(p.grad is None for p in inner.parameters()), f"{what}: reduced"
    elif strategy.params_sharded and strategy.mesh.ndim == 1:
        # Reduce-scattered already: each rank holds only its shard of each gradient.
        shards = [p.grad.to_local().numel() for p in inner.parameters()]
        assert sum(shards) < sum(p.numel() for p in inner.parameters()), (what, shards)
    elif not strategy.params_sharded:
        local = inner.head.weight.grad.clone()
        peers = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(peers, local)
        assert not all(torch.equal(p, peers[0]) for p in peers), f"{what}: reduced"
    (torch.nn.functional.mse_loss(model(x[half:]), y[half:]) / 2).backward()
    ref = reference_model()
    torch.nn.functional.mse_loss(ref(make_batch()[0]), make_batch()[1]).backward()
    _assert_close(_grads(model), _grads(ref), what=what)


def check_tied_weights(name, rank, world):
    # Asking to shard every Linear: the two tied ones must share one unit.
    overrides = {"fsdp_block_classes": ["Linear"]} if name != "ddp" else {}
    kw = dict(dim_in=16, dim_out=16, tied=True)
    strategy, model = _wrapped(name, rank, model_kwargs=kw, **overrides)
    inner = getattr(model, "module", model)
    assert inner.head.weight is inner.inp.weight
    _train(model, _local_batch(*make_batch(dim_in=16, dim_out=16), rank, world), strategy=strategy)
    ref = reference_model(**kw)
    _train(ref, make_batch(dim_in=16, dim_out=16))
    _assert_close(_params(model), _params(ref), what=f"{name} tied weights")
    # Built on the meta device, the tie survives materialisation (to_empty unties).
    with torch.device("meta"):
        meta = ToyNet(**kw)
    inner = getattr(strategy.wrap(meta), "module", meta)
    assert inner.head.weight is inner.inp.weight, f"{name}: meta init untied the weights"


def check_activation_checkpointing(name, rank, world):
    strategy, model = _wrapped(name, rank, use_gradient_checkpointing=True)
    inner = getattr(model, "module", model)
    calls = []
    inner.layers[0].fc.register_forward_hook(lambda *a: calls.append(1))
    _train(model, _local_batch(*make_batch(), rank, world), strategy=strategy)
    assert len(calls) == 2 * STEPS, f"{name}: block forward ran {len(calls)} times, not recomputed"
    want, _ = _reference()
    _assert_close(_params(model), want, what=f"{name} with activation checkpointing")


def check_meta_device_model(name, rank, world):
    strategy = build_strategy(_config(name), device=torch.device("cpu"), local_rank=rank)
    with torch.device("meta"):
        model = ToyNet()
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = strategy.wrap(model)
    # Random fills of CPU-mesh DTensors never reach torch's DTensor RNG, which
    # warns on CPU meshes (strategies/cpu_rng.py).
    assert not [w for w in caught if "DTensor random operators" in str(w.message)], name
    inner = getattr(model, "module", model)
    assert not any(t.is_meta for t in [*inner.parameters(), *inner.buffers()])
    # The sharded init is the one-process init from the same seed (on CPU
    # meshes each shard used to repeat the first: equal halves).
    torch.manual_seed(5)
    with torch.device("meta"):
        ref = ToyNet()
    materialize_meta_module(ref, "cpu")
    want, got = dict(ref.named_parameters()), _params(model)
    assert got.keys() == want.keys(), name
    for key, value in got.items():
        assert torch.equal(value, want[key]), (name, key)
    losses, _ = _train(model, _local_batch(*make_batch(), rank, world), steps=5, strategy=strategy)
    assert all(torch.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    # Every replica must start from the same values, or DDP/HSDP replicas drift apart.
    for p in _params(model).values():
        gathered = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(gathered, p)
        assert all(torch.equal(g, gathered[0]) for g in gathered), name


def check_bf16_mixed_precision(name, rank, world):
    # The default config's mixed precision comes from wrap alone: FSDP2 casts
    # through its policy (offload requested: CPU workers log it and train
    # on), DDP autocasts the forward.
    if name == "ddp":
        cfg = FSDPConfig(use_fsdp=False)
    else:
        cfg = FSDPConfig(use_fsdp=True, fsdp_sharding_strategy=name, fsdp_cpu_offload=True)
    strategy = build_strategy(cfg, device=torch.device("cpu"), local_rank=rank)
    model = strategy.wrap(reference_model())
    compute = []
    inner = getattr(model, "module", model)
    inner.layers[0].fc.register_forward_hook(lambda m, i, o: compute.append(o.dtype))
    x, y = _local_batch(*make_batch(), rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    assert compute and all(d == torch.bfloat16 for d in compute), (name, compute)
    # Master weights stay fp32; bf16 compute moves them only slightly off the fp32 run.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    want, _ = _reference()
    _assert_close(_params(model), want, atol=3e-2, what=f"{name} bf16")
    assert losses[-1] < losses[0], losses


CHECKS = [
    check_training_matches_reference,
    check_shard_fraction,
    check_clipping,
    check_no_sync_accumulation,
    check_tied_weights,
    check_activation_checkpointing,
    check_meta_device_model,
    check_bf16_mixed_precision,
]


def _all_strategies(rank, world, local_world):
    # Two "nodes" of local_world ranks each, as torchrun would number them.
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    done = []
    for name in STRATEGIES:
        for check in CHECKS:
            check(name, rank, world)
            done.append((name, check.__name__))
    return done, _ddp_buffers(rank, world) if world == 2 else None


@pytest.fixture(scope="module")
def spawned():
    """World size -> (the checks done, DDP's buffers at 2 ranks)."""
    return {world: run_ranks(_all_strategies, world, world // 2) for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_matches_single_process(spawned, world):
    done, _ = spawned[world]
    assert len(done) == len(STRATEGIES) * len(CHECKS)


class _Counter(torch.nn.Module):
    """A linear layer and a buffer that differs on every rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.register_buffer("seen", torch.full((1,), float(rank)))

    def forward(self, x):
        return self.linear(x)


def _ddp_buffers(rank, world):
    import warnings

    out = {}
    for broadcast in (True, False):
        strategy = build_strategy(
            _config("ddp", broadcast_buffers=broadcast), device=torch.device("cpu"), local_rank=rank
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = strategy.wrap(_Counter(rank))
        model(torch.ones(1, 2)).sum().backward()
        seen = [None] * world
        dist.all_gather_object(seen, float(model.module.seen))
        out[broadcast] = {
            "seen": seen,
            "deprecation": any(issubclass(w.category, FutureWarning) for w in caught),
        }
    return out


def test_ddp_broadcast_buffers(spawned):
    """True: every rank gets rank 0's buffers (and no deprecation warning
    from torch 2.13's renamed argument); False: buffers stay rank-local
    (in the 2-rank job, after the strategies' checks)."""
    _, out = spawned[2]
    assert out[True] == {"seen": [0.0, 0.0], "deprecation": False}
    assert out[False]["seen"] == [0.0, 1.0]
