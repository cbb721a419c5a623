"""DMuon on stacked expert matrices in one process: each expert's matrix is
orthogonalised on its own (bitwise torch's Muon expert by expert), the
default choice takes the experts' stacks, and ``ray-fsdp plan`` prints
that they cost no exchange."""

from __future__ import annotations

import copy

import pytest
import torch

from ray_fsdp_backend import dmuon
from ray_fsdp_backend.cli.main import main
from ray_fsdp_backend.dmuon.report import format_stack_lines
from ray_fsdp_backend.dmuon.selection import dedicated_specs, dedicated_stacks, select_parameters
from ray_fsdp_backend.dmuon.stacks import orthogonalize_stacks

transformers = pytest.importorskip("transformers")
HYPER = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1)
STACKS = {
    f"model.layers.{i}.mlp.experts.{n}" for i in (0, 1) for n in ("gate_up_proj", "down_proj")
}


def tiny_moe() -> torch.nn.Module:
    from tests.dist.test_expert_parallel import tiny_moe_config

    torch.manual_seed(3)
    return transformers.AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe"))


def test_default_choice_takes_the_expert_stacks_and_plans_only_matrices():
    model = tiny_moe()
    dedicated, rest = select_parameters(model)
    assert STACKS <= {n for n, _ in dedicated}
    assert not any(".experts." in n for n, _ in rest)
    assert {s.name for s in dedicated_specs(model)} == {n for n, p in dedicated if p.ndim == 2}
    assert dedicated_stacks(model) == [(8, 32, 32), (8, 32, 16)] * 2


def tiny_gpt_oss() -> torch.nn.Module:
    """gpt-oss: experts with 2-D bias stacks (``gate_up_proj_bias`` ``[E, 2I]``)."""
    from tests.zoo_families import build_family

    model = build_family("gpt_oss", seed=3)
    with torch.no_grad():  # biases and router that move the loss (gpt-oss inits them to 0)
        for name, p in model.named_parameters():
            if "bias" in name or "router" in name:
                p.normal_(0, 0.2)
    return model


def test_default_choice_leaves_expert_bias_stacks_to_adamw():
    dedicated, rest = select_parameters(tiny_gpt_oss())
    biases = {f"model.layers.{i}.mlp.experts.{n}_bias" for i in (0, 1) for n in GPT_OSS}
    assert biases <= {n for n, _ in rest}
    assert {f"model.layers.{i}.mlp.experts.{n}" for i in (0, 1) for n in GPT_OSS} <= {
        n for n, _ in dedicated
    }


GPT_OSS = ("gate_up_proj", "down_proj")


@pytest.mark.parametrize("build", [tiny_moe, tiny_gpt_oss], ids=["qwen3_moe", "gpt_oss"])
def test_equals_torch_muon_expert_by_expert_bitwise(build):
    """torch's Muon on every expert's matrix as its own parameter and on the
    blocks' other 2-D weights; AdamW on the rest, the experts' 1-D and 2-D
    biases among them."""
    model = build()
    ref = copy.deepcopy(model)
    opt = dmuon.Muon(model, **HYPER, adamw_lr=1e-3)
    named = list(ref.named_parameters())
    names = {n for n, p in named if p.ndim == 3}
    stacks = [p for n, p in named if n in names]
    proxies = [[torch.nn.Parameter(m.detach().clone()) for m in p] for p in stacks]
    layers = [(n, p) for n, p in named if n.startswith("model.layers.")]
    matrices = [p for n, p in layers if p.ndim == 2 and ".experts." not in n]
    muon = torch.optim.Muon(matrices + [q for qs in proxies for q in qs], **HYPER)
    rest = [p for n, p in named if p.ndim == 1 or "layers" not in n or n.endswith("_bias")]
    adamw = torch.optim.AdamW(
        rest, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True
    )
    tokens = torch.randint(0, 96, (2, 2, 9), generator=torch.Generator().manual_seed(4))
    for rows in tokens:
        for m in (model, ref):
            loss = m(rows[:, :-1]).logits.flatten(0, 1)
            torch.nn.functional.cross_entropy(loss, rows[:, 1:].flatten()).backward()
        for p, qs in zip(stacks, proxies, strict=True):
            for q, g in zip(qs, p.grad, strict=True):
                q.grad = g.clone()
        for o in (opt, muon, adamw):
            o.step()
        with torch.no_grad():
            for p, qs in zip(stacks, proxies, strict=True):
                p.copy_(torch.stack(list(qs)))
        model.zero_grad()
        ref.zero_grad()
    for (name, got), want in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(got, want), name
    done = opt.last_step_stats.orthogonalized
    experts = len(stacks[0])
    assert {n for n in done if ".experts." in n} == {
        f"{s}[{e}]" for s in names for e in range(experts)
    }


def test_orthogonalize_stacks_batches_by_matrix_shape():
    calls = []

    def orthogonalize(stacks):
        calls.append({s: t.shape[0] for s, t in stacks.items()})
        return {s: t * 2 for s, t in stacks.items()}

    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(n, r, c, generator=g) for n, r, c in ((2, 4, 3), (3, 3, 4), (1, 4, 3))]
    out = orthogonalize_stacks(updates + [torch.empty(0, 5, 5)], orthogonalize)
    assert calls == [{(4, 3): 3, (3, 4): 3}]  # one call per shape; the empty stack skipped
    for u, o in zip(updates, out[:3], strict=True):
        assert torch.equal(o, u * 2)


def test_stack_lines_count_experts_per_rank():
    (line,) = format_stack_lines([(8, 32, 32), (8, 32, 16)], ep=2, efsdp=2)
    assert "16 expert matrices in 2 stacks" in line
    assert "at most 2 of a stack per rank" in line and "0 B over ep or efsdp" in line
    assert format_stack_lines([], ep=2, efsdp=2) == []


def test_plan_with_dmuon_and_ep_routers_replace_mlps_and_experts_cost_no_exchange(capsys):
    sets = ["distributed.expert_parallel_size=8", "distributed.use_dmuon=true",
            "train.optimizer=muon"]  # fmt: skip
    argv = ["plan", "examples/fsdp_1node_8gpu.yaml", "--nodes", "2", "--gpus-per-node", "8"]
    argv += ["--hf-config", "examples/qwen3_30b_a3b.config.json"]
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "Newton–Schulz on 240 matrices" in out  # 48 layers x (4 attention + router)
    assert "12,288 expert matrices in 96 stacks" in out  # 48 x 128 x (gate_up, down)
    assert "ep=8 x efsdp=2" in out and "at most 16 of a stack per rank" not in out
    assert "at most 8 of a stack per rank): no exchange, 0 B over ep or efsdp" in out
