"""clip_grad_norm_ on one process against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.distributed.clip import clip_grad_norm_


def _params(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def _pair(*grads):
    return _params(*grads), _params(*grads)


@pytest.mark.parametrize(
    "grads",
    [
        (torch.full((3, 4), 2.0), torch.arange(5.0)),  # clipped
        (torch.full((3,), 1e-3),),  # under the limit: untouched
        (torch.full((3, 4), 1e20), torch.ones(2)),  # norm overflows fp32: torch zeroes
        (torch.tensor([float("nan"), 1.0]),),
    ],
)
def test_same_gradients_and_norm_as_torch(grads):
    ours, ref = _pair(*grads)
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    stats = clip_grad_norm_(ours, 1.0)
    torch.testing.assert_close(stats.total_norm, expected, equal_nan=True)
    for p, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad, equal_nan=True)
    assert isinstance(stats.clip_coef, torch.Tensor)  # no host sync to compute it


@pytest.mark.parametrize("max_norm", [None, float("inf")])
def test_no_limit_measures_and_leaves_gradients(max_norm):
    ours, ref = _pair(torch.full((3, 4), 2.0))
    expected = torch.nn.utils.get_total_norm([r.grad for r in ref])
    stats = clip_grad_norm_(ours, max_norm)
    torch.testing.assert_close(stats.total_norm, expected)
    assert torch.equal(ours[0].grad, ref[0].grad) and float(stats.clip_coef) == 1.0


@pytest.mark.parametrize("max_norm", [0, -1.0])
def test_non_positive_limit_is_an_error(max_norm):
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(_params(torch.ones(2)), max_norm)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, 0.5, float("inf")])
def test_every_norm_type_matches_torch(norm_type):
    g = torch.Generator().manual_seed(0)
    grads = (torch.randn(3, 4, generator=g) * 3, torch.randn(5, generator=g))
    ours, ref = _pair(*grads)
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type)
    stats = clip_grad_norm_(ours, 0.5, norm_type=norm_type)
    torch.testing.assert_close(stats.total_norm, expected)
    for p, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad)


def test_non_positive_norm_type_is_an_error():
    with pytest.raises(ValueError, match="norm_type=0.0 must be positive or inf"):
        clip_grad_norm_(_params(torch.ones(2)), 1.0, norm_type=0)


def test_an_empty_local_shard_adds_nothing_to_any_norm():
    for norm_type in (2.0, float("inf")):
        ours, ref = _pair(torch.arange(6.0), torch.zeros(0, 3))
        expected = torch.nn.utils.get_total_norm([ref[0].grad], norm_type)
        torch.testing.assert_close(
            clip_grad_norm_(ours, None, norm_type=norm_type).total_norm, expected
        )


def test_a_rank_without_gradients_computes_its_zero_on_the_given_device():
    """A frozen pipeline stage holds no gradient, yet joins the pp
    all-reduce: its zero must be on the rank's compute device (``meta`` here
    stands in for ``cuda``). It was made on the host, which NCCL refuses."""
    frozen = [torch.nn.Parameter(torch.ones(3), requires_grad=False)]
    stats = clip_grad_norm_(frozen, 1.0, device="meta")
    assert stats.total_norm.device.type == "meta"
    assert stats.clip_coef.device.type == "meta"
    plain = clip_grad_norm_(_params(torch.ones(4)), None, device="meta")
    assert plain.total_norm.device.type == "meta"
