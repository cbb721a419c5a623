"""Saving before the first optimizer step leaves training as it would have been."""

from __future__ import annotations

import torch

from ray_fsdp_backend.checkpoint.sharded import _state_to_save


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model, opt):
    model(torch.ones(2, 4)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_state_taken_before_the_first_step_changes_nothing():
    reference, ref_opt = _model_and_opt()
    model, opt = _model_and_opt()
    saved = _state_to_save(model, opt)
    assert all(float(s["step"]) == 0 for s in saved["optim"]["state"].values())
    for _ in range(2):
        _step(reference, ref_opt)
        _step(model, opt)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
    assert float(opt.state[model.weight]["step"]) == 2.0
