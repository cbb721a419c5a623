"""DMuon in one process (plain tensors, no process group): bit-for-bit
``torch.optim.Muon`` + ``torch.optim.AdamW``, parameter selection, groups,
state and argument errors. The distributed behaviour is in tests/dist."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from ray_fsdp_backend import dmuon
from ray_fsdp_backend.distributed.clip import clip_grad_norm_
from ray_fsdp_backend.dmuon.newton_schulz import NS_COEFFICIENTS, NS_EPS
from tests.models import make_batch, reference_model

MUON_NAMES = ["layers.0.fc.weight", "layers.1.fc.weight"]


def step_both(model, ref, opts, steps=3, seed=1):
    for k in range(steps):
        x, y = make_batch(seed=seed + k)
        for m in (model, ref):
            torch.nn.functional.mse_loss(m(x), y).backward()
        for o in opts:
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("shape", [(3, 8, 16), (2, 16, 8), (1, 5, 5)])
def test_batched_newton_schulz_equals_torch_bitwise_in_bf16(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    got = dmuon.zeropower_via_newtonschulz(g)
    want = torch.stack([_zeropower_via_newtonschulz(m, NS_COEFFICIENTS, 5, NS_EPS) for m in g])
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    fp32 = dmuon.zeropower_via_newtonschulz(g, dtype=torch.float32)
    assert fp32.dtype == torch.float32
    assert (fp32 - want.float()).abs().max() < 0.05


@pytest.mark.parametrize("nesterov, adjust", [(True, None), (False, "match_rms_adamw")])
def test_equals_torch_muon_plus_adamw_bitwise(nesterov, adjust):
    model = reference_model()
    ref = copy.deepcopy(model)
    hyper = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1, adjust_lr_fn=adjust)
    opt = dmuon.Muon(model, **hyper, adamw_lr=1e-3, adamw_weight_decay=0.01)
    assert opt.param_names == tuple(MUON_NAMES)
    named = dict(ref.named_parameters())
    muon = torch.optim.Muon([named[n] for n in MUON_NAMES], **hyper)
    adamw = torch.optim.AdamW(
        [p for n, p in named.items() if n not in MUON_NAMES],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.01,
        fused=True,
    )
    step_both(model, ref, [opt, muon, adamw])
    for (name, got), want in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(got, want), name
    assert opt.last_step_stats.orthogonalized == tuple(MUON_NAMES)
    assert opt.last_step_stats.ns_calls == 1  # both matrices share a shape: one batch


def test_groups_are_named_and_follow_an_lr_scheduler():
    opt = dmuon.Muon(reference_model(), lr=0.02, adamw_lr=1e-3)
    assert [g["name"] for g in opt.param_groups] == [dmuon.MUON_GROUP, dmuon.ADAMW_GROUP]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 5e-4]


def test_state_exists_from_construction_and_round_trips():
    model = reference_model()
    opt = dmuon.Muon(model, lr=0.02)
    assert len(opt.state) == len(list(model.parameters()))  # every key, before any step
    twin = copy.deepcopy(model)
    step_both(model, twin, [opt], steps=2)
    twin.load_state_dict(model.state_dict())
    twin.zero_grad()
    resumed = dmuon.Muon(twin, lr=0.02)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if from a file
    step_both(model, twin, [opt, resumed], steps=2, seed=7)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_frozen_parameters_are_left_out():
    model = reference_model()
    model.layers[0].fc.weight.requires_grad_(False)
    opt = dmuon.Muon(model, lr=0.02)
    assert opt.param_names == ("layers.1.fc.weight",)


def test_clip_over_the_optimizer_clips_all_groups_with_one_norm():
    model = reference_model()
    opt = dmuon.Muon(model, lr=0.02)
    x, y = make_batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    stats = clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1e-3)
    assert float(stats.total_norm) == pytest.approx(float(want), rel=1e-6)
    assert stats.as_dict()["clip_coef"] < 1.0
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(after) == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(is_dedicated=lambda n, p: True), "'layers.0.norm.weight' has shape"),
        (dict(lr=-1.0), "lr=-1.0"),
        (dict(adjust_lr_fn="rms"), "adjust_lr_fn='rms'"),
        (dict(ns_steps=0), "ns_steps=0"),
        (dict(ns_dtype=torch.int8), "ns_dtype=torch.int8"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dmuon.Muon(reference_model(), **{"lr": 0.02, **kwargs})


def test_blocks_are_the_nested_units_or_module_list_children():
    from ray_fsdp_backend.dmuon.selection import _is_ancestor, block_prefixes

    assert block_prefixes(reference_model()) == ("layers.0", "layers.1")
    assert _is_ancestor("", "layers.0") and _is_ancestor("model", "model.layers.0")
    assert not _is_ancestor("model.layers.1", "model.layers.10")
    assert not _is_ancestor("layers.0", "layers.0")


class _Adapted(torch.nn.Module):
    """A model with the seed's adapter hook, recording what it was asked."""

    def __init__(self):
        super().__init__()
        self.inner = reference_model()
        self.asked = None

    def convert_to_fsdp(self, **kwargs):
        self.asked = kwargs
        return self


def test_strategy_tells_the_adapter_dmuon_is_on_and_clips_everything_once():
    from ray_fsdp_backend import FSDPConfig
    from ray_fsdp_backend.strategies.dmuon import DMuonFSDPStrategy

    config = FSDPConfig(use_fsdp=True, use_dmuon=True, use_mixed_precision=False)
    strategy = DMuonFSDPStrategy(config, device=torch.device("cpu"), mesh=None)
    model = strategy.wrap(_Adapted())
    assert model.asked["use_dmuon"] is True
    opt = dmuon.Muon(model, lr=0.02)
    x, y = make_batch()
    torch.nn.functional.mse_loss(model.inner(x), y).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm = strategy.clip_grad_norm(model, 1e-3, optimizer=opt)
    assert float(norm) == pytest.approx(float(want), rel=1e-6)
    assert strategy.last_grad_clip_stats["num_tensors"] == len(list(model.parameters()))
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(after) == pytest.approx(1e-3, rel=1e-3)


def test_newton_schulz_runs_on_the_accelerator_under_cpu_offload():
    from ray_fsdp_backend.dmuon.optimizer import resolve_ns_device

    # Offload: the shard sits on the host, the mesh (and compute) on the GPU.
    assert resolve_ns_device(torch.device("cpu"), "cuda") == torch.device("cuda")
    assert resolve_ns_device(torch.device("cuda", 3), "cuda") == torch.device("cuda", 3)
    assert resolve_ns_device(torch.device("cpu"), "cpu") == torch.device("cpu")


def _state_snapshot(model, opt) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
    return tensors


def test_found_inf_skips_the_whole_step_and_zero_changes_nothing():
    from ray_fsdp_backend.distributed.step_guard import step_if_finite, supports_found_inf

    model, hyper = reference_model(), dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    twin = copy.deepcopy(model)
    opt, twin_opt = dmuon.Muon(model, **hyper), dmuon.Muon(twin, **hyper)
    assert supports_found_inf(opt)
    step_both(model, twin, [opt, twin_opt], steps=2)  # momentum and moments are non-zero
    before = _state_snapshot(model, opt)
    x, y = make_batch(seed=7)
    torch.nn.functional.mse_loss(model(x), y).backward()
    for p in model.parameters():
        p.grad.mul_(float("inf"))  # inf and NaN gradients, as after a bad step
    found_inf = step_if_finite(opt, clip_grad_norm_(model.parameters(), 1.0).total_norm)
    assert found_inf == 1
    after = _state_snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # found_inf 0: bit for bit the plain step.
    opt.zero_grad()
    for m in (model, twin):
        torch.nn.functional.mse_loss(m(x), y).backward()
    opt.found_inf, opt.grad_scale = torch.zeros(()), None
    opt.step()
    twin_opt.step()
    got, want = _state_snapshot(model, opt), _state_snapshot(twin, twin_opt)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
