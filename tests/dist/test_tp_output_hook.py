"""FSDP2's pre-backward hook stays on a tensor-parallel model's output.

FSDP2 hooks its pre-backward all-gather on the root module's outputs and
warns when an output is a view ("returned a view tensor ... will silently
drop the pre-backward hook"): an in-place op on a view loses the hook. The
tp output head gathered its logits with ``DTensor.to_local`` (a view); it
now returns a tensor of its own. On 2 gloo ranks (tp 2) the warning is an
error, the loss takes an in-place op on the logits (as a user's loss
function may), and every gradient equals one process's on the same weights
and data (fp32 and bf16 mixed precision). With the head's view restored the
test fails on the warning; without the warning filter the in-place op raises
("Output 0 of _ToTorchTensor is a view and is being modified inplace").
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.distributed.tensor import distribute_tensor

from ray_fsdp_backend import FSDPConfig, build_strategy
from ray_fsdp_backend.distributed.mesh import build_device_mesh, resolve_layout
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.planning.topology import topology_from_node_counts
from tests.dist.harness import run_ranks

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)
VIEW_WARNING = ".*returned a view tensor"


def _loss(model, tokens):
    logits = model(tokens)
    logits.mul_(2.0)  # in place on the model's output: the hook must survive it
    return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def _grads(model):
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
        for n, p in model.named_parameters()
    }


def _tp_grads(rank, world, state, tokens):
    out = {}
    for mixed in (False, True):
        cfg = FSDPConfig(use_fsdp=True, tensor_parallel_size=2, use_mixed_precision=mixed)
        layout = resolve_layout(cfg, topology_from_node_counts([world]))
        mesh = build_device_mesh(layout, "cpu")
        strategy = build_strategy(cfg, device=torch.device("cpu"), local_rank=rank, mesh=mesh)
        with torch.device("meta"):
            model = Transformer(CFG)
        model = strategy.wrap(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(_slice(p, state[name]))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=VIEW_WARNING)
            _loss(model, tokens).backward()
        out[mixed] = _grads(model)
    return out


def _slice(param, full):
    return distribute_tensor(full, param.device_mesh, param.placements).to_local()


def test_tp_output_keeps_pre_backward_hook():
    torch.manual_seed(0)
    reference = Transformer(CFG)
    state = {n: p.detach().clone() for n, p in reference.named_parameters()}
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    got = run_ranks(_tp_grads, 2, state, tokens)
    _loss(reference, tokens).backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    for mixed, tol in ((False, 1e-5), (True, 5e-2)):
        assert got[mixed].keys() == want.keys()
        for name, grad in want.items():
            err = (got[mixed][name] - grad).abs().max() / grad.abs().max()
            assert err < tol, (mixed, name, float(err))
