"""Expert parallelism's pure parts: the ep / efsdp groups carved out of
dp_shard x cp, the config refusals, and the ep plan's refusals (no worker,
no process group)."""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.distributed.mesh import resolve_layout
from ray_fsdp_backend.planning.topology import compute_mesh_layout, topology_from_node_counts
from ray_fsdp_backend.settings.config import FSDPSettings, ShardingStrategy

FULL, HYBRID = ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD


def _layout(nodes, strategy=FULL, ep=1, **kwargs):
    return compute_mesh_layout(
        strategy, topology_from_node_counts(nodes), expert_parallel_size=ep, **kwargs
    )


def test_ep_one_leaves_the_layout_unchanged():
    for nodes, strategy in (([4], FULL), ([2, 2], HYBRID)):
        assert _layout(nodes, strategy) == compute_mesh_layout(
            strategy, topology_from_node_counts(nodes)
        )
    assert _layout([4]).expert_groups("ep") == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize(
    ("nodes", "strategy", "ep", "inner", "ep_groups", "efsdp_groups"),
    [
        ([4], FULL, 2, (), ((0, 1), (2, 3)), ((0, 2), (1, 3))),
        ([4], FULL, 4, (), ((0, 1, 2, 3),), ((0,), (1,), (2,), (3,))),
        ([2, 2], HYBRID, 2, (), ((0, 1), (2, 3)), ((0,), (1,), (2,), (3,))),
        ([4, 4], HYBRID, 2, (), ((0, 1), (2, 3), (4, 5), (6, 7)), ((0, 2), (1, 3), (4, 6), (5, 7))),
        # cp inside dp_shard: an ep group of 4 takes two dp_shard ranks' cp pairs
        (
            [8],
            FULL,
            4,
            (("cp", 2),),
            ((0, 1, 2, 3), (4, 5, 6, 7)),
            ((0, 4), (1, 5), (2, 6), (3, 7)),
        ),
    ],
)
def test_expert_groups(nodes, strategy, ep, inner, ep_groups, efsdp_groups):
    layout = _layout(nodes, strategy, ep, inner_axes=inner)
    assert layout.expert_groups("ep") == ep_groups
    assert layout.expert_groups("efsdp") == efsdp_groups
    assert layout.expert_shard_size == len(efsdp_groups[0])
    for group in ep_groups:  # ep rank r at position r of its group
        assert [layout.expert_coordinates(r)["ep"] for r in group] == list(range(ep))
    # EP changes no data coordinate
    plain = _layout(nodes, strategy, 1, inner_axes=inner)
    for rank in layout.ranks:
        assert layout.data_parallel_coordinates(rank) == plain.data_parallel_coordinates(rank)


def test_ep_not_dividing_shard_x_cp_is_refused_before_workers():
    config = FSDPSettings(use_fsdp=True, expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 must divide dp_shard x cp = 4"):
        resolve_layout(config, topology_from_node_counts([4]))
    hsdp = FSDPSettings(
        use_fsdp=True, fsdp_sharding_strategy="hybrid_shard", expert_parallel_size=4
    )
    with pytest.raises(ValueError, match=r"dp_shard x cp = 2 .*allowed: \[1, 2\]"):
        resolve_layout(hsdp, topology_from_node_counts([2, 2]))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(expert_parallel_size=0), "expert_parallel_size=0 must be a positive int"),
        (dict(expert_parallel_size=2), "expert_parallel_size=2 needs use_fsdp=true"),
        (
            dict(use_fsdp=True, expert_parallel_size=2, tensor_parallel_size=2),
            "tensor_parallel_size=2 is not supported",
        ),
        (dict(use_fsdp=True, expert_parallel_size=True), "expert_parallel_size=True has type bool"),
    ],
)
def test_config_refusals(values, message):
    with pytest.raises(ValueError, match=message):
        FSDPSettings.from_dict(values)


def test_yaml_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("distributed:\n  use_fsdp: true\n  expert_parallel_size: 2\n")
    assert FSDPSettings.from_yaml(path).expert_parallel_size == 2
    assert FSDPSettings().expert_parallel_size == 1


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_ep_plan_expands_and_refuses():
    transformers = pytest.importorskip("transformers")
    from ray_fsdp_backend.strategies.expert_parallel import resolve_ep_plan

    moe = _meta_model(
        transformers.Qwen3MoeConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_experts=6,
            moe_intermediate_size=8,
        )
    )
    plan = resolve_ep_plan(moe, 2)
    assert plan["model.layers.1.mlp.experts"] == "ep_dispatch_experts"
    assert plan["model.layers.0.mlp.experts.gate_up_proj"] == "grouped_gemm"
    assert len(plan) == 6
    with pytest.raises(
        ValueError, match=r"expert_parallel_size=4 must divide the expert count .*6 experts"
    ):
        resolve_ep_plan(moe, 4)
    dense = _meta_model(
        transformers.LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    )
    with pytest.raises(
        ValueError, match=r"expert_parallel_size=2: LlamaForCausalLM has no experts"
    ):
        resolve_ep_plan(dense, 2)


def test_plan_prints_the_expert_groups():
    from ray_fsdp_backend.cli.plan_report import format_expert_groups

    assert format_expert_groups(_layout([4])) == []
    assert format_expert_groups(_layout([4], ep=2)) == [
        "experts:  expert_parallel_size=2: each rank holds 1/2 of every MoE layer's experts, "
        "FSDP2-sharded over 2 ranks",
        "ep groups (2; tokens to their experts by all-to-all):",
        "  [0, 1]",
        "  [2, 3]",
        "efsdp groups (2; same experts: all-gather, reduce-scatter):",
        "  [0, 2]",
        "  [1, 3]",
    ]


def test_renamed_key_map_finds_per_expert_keys_under_a_prefix():
    from ray_fsdp_backend.hf.experts import renamed_key_map

    p = "base_model.model."
    names = {
        f"m.0.mlp.{k}": f"{p}m.0.mlp.{k}"
        for k in ("experts.gate_up_proj", "experts.down_proj", "gate.weight")
    }
    key_map = renamed_key_map(names)
    assert key_map("m.0.mlp.gate.weight") == f"{p}m.0.mlp.gate.weight"
    assert key_map("m.0.mlp.experts.3.up_proj.weight") == f"{p}m.0.mlp.experts.3.up_proj.weight"
    # Mixtral's checkpoint names: the router, and the experts under the fused key's prefix
    assert key_map("m.0.block_sparse_moe.gate.weight") == f"{p}m.0.mlp.gate.weight"
    assert key_map("m.0.block_sparse_moe.experts.1.w2.weight") == f"{p}m.0.mlp.experts.1.w2.weight"
    assert key_map("m.1.mlp.experts.0.up_proj.weight") is None  # no such layer
    assert key_map("other.weight") is None


def _router_reference(model, ids, top_k: int) -> dict[str, float]:
    """Each layer's max over mean (token, expert) count from the router logits
    transformers returns (``output_router_logits``), not from any hook."""
    out = model(ids, output_router_logits=True)
    ratios = {}
    for layer, logits in enumerate(out.router_logits):
        index = torch.topk(logits.float(), top_k, dim=-1).indices.flatten()
        counts = torch.bincount(index, minlength=logits.shape[-1]).double()
        ratios[f"router/layer{layer}/max_over_mean"] = float(counts.max() / counts.mean())
    return ratios


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=8)),
        ("gpt_oss", dict(num_local_experts=4, head_dim=8)),  # its router is mlp.router
    ],
)
def test_router_stats_hook_the_family_routers_count_and_reset(family, extra):
    transformers = pytest.importorskip("transformers")
    from ray_fsdp_backend.metrics.router import RouterStats, find_routers

    config = _tiny_moe_config(family, num_experts_per_tok=2, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # uneven routing (gpt-oss starts its router at 0)
        for _, module in find_routers(model):
            module.weight.normal_(0, 1.0)
    assert len(find_routers(model)) == 2
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    stats = RouterStats(model)
    assert stats.collect() == {}
    with torch.no_grad():
        want = _router_reference(model, ids, 2)
        model(ids)  # the reference ran one forward too: twice the counts, same ratios
    got = stats.collect()
    assert got == pytest.approx(want, rel=1e-12) and max(got.values()) > 1.0
    assert stats.collect() == {}
    stats.close()
    with torch.no_grad():
        model(ids)
    assert stats.collect() == {}


def _tiny_moe_config(family: str, **extra):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.for_model(
        family,
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **extra,
    )


def test_ep_refuses_lora_on_the_experts_by_name():
    """PEFT ``target_parameters`` on the experts wraps ``mlp.experts``: the
    dispatch would land on the wrapper and the adapters stay whole on every
    rank, so ep > 1 refuses it; LoRA on the attention passes."""
    peft = pytest.importorskip("peft")
    from ray_fsdp_backend.strategies.expert_parallel import resolve_ep_plan

    def with_lora(**targets):
        model = _meta_model(_tiny_moe_config("qwen3_moe", num_experts=4, moe_intermediate_size=8))
        return peft.get_peft_model(model, peft.LoraConfig(r=2, **targets))

    experts = with_lora(target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    message = r"expert_parallel_size=2: a peft adapter wraps the experts 'base_model.model.model"
    with pytest.raises(ValueError, match=message + r"\.layers\.0\.mlp\.experts'"):
        resolve_ep_plan(experts, 2)
    attention = with_lora(target_modules=["q_proj"])
    assert len(resolve_ep_plan(attention, 2)) == 6


def test_ep_refuses_llama4_as_experts_without_a_plan():
    transformers = pytest.importorskip("transformers")
    from ray_fsdp_backend.strategies.expert_parallel import resolve_ep_plan

    config = transformers.Llama4TextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, intermediate_size_mlp=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_local_experts=4,
    )  # fmt: skip
    message = r"Llama4ForCausalLM is a mixture-of-experts model \(4 experts\) whose transformers"
    with pytest.raises(ValueError, match=message + " class declares no expert-parallel plan"):
        resolve_ep_plan(_meta_model(config), 2)
