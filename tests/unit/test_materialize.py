"""materialize_meta_module on one process: only meta tensors are allocated,
buffers go to the compute device, and nothing is left uninitialised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ray_fsdp_backend.strategies.blocks import materialize_meta_module


class Scaled(nn.Module):
    """A parameter and a buffer, both reset by ``reset_parameters``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))
        self.register_buffer("scale", torch.empty(4), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)
        self.scale.fill_(2.0)


class OnlyBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.ones(1000))


def test_real_weights_of_a_partly_meta_model_survive():
    real = nn.Linear(3, 3)
    with torch.no_grad():
        real.weight.fill_(42.0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), real)
    model[1] = real
    torch.manual_seed(0)
    materialize_meta_module(model, "cpu")
    assert torch.equal(model[1].weight, torch.full((3, 3), 42.0))
    torch.manual_seed(0)
    reference = nn.Linear(3, 3)  # what reset_parameters gives the meta layer
    torch.testing.assert_close(model[0].weight, reference.weight)


def test_buffer_only_module_without_initialiser_is_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), OnlyBuffer())
    with pytest.raises(ValueError, match="OnlyBuffer"):
        materialize_meta_module(model, "cpu")


def test_buffers_go_to_the_buffer_device_parameters_to_the_parameter_device():
    with torch.device("meta"):
        model = Scaled()
    # "meta" stands in for the accelerator: parameters on the host (offload),
    # buffers where compute runs.
    materialize_meta_module(model, "cpu", buffer_device="meta")
    assert model.weight.device.type == "cpu" and torch.equal(model.weight, torch.ones(4))
    assert model.scale.is_meta


def test_default_puts_everything_on_one_device_and_initialises_it():
    with torch.device("meta"):
        model = Scaled()
    materialize_meta_module(model, "cpu")
    assert torch.equal(model.scale, torch.full((4,), 2.0))
