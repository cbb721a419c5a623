"""``ray-fsdp plan --hf-config`` for mixture-of-experts models: the shipped
Qwen3-30B-A3B shape planned at ep 8 on 2 nodes x 8 GPUs, every printed
number checked against hand arithmetic, and the Mixtral / DeepSeek-V3 key
families counted to their published sizes (pure: no worker, no torch)."""

from __future__ import annotations

import pytest

from ray_fsdp_backend.cli.main import main
from ray_fsdp_backend.planning.experts import moe_model_from_hf
from ray_fsdp_backend.planning.memory import ExpertShape, estimate_expert_traffic, format_bytes

QWEN3_30B = "examples/qwen3_30b_a3b.config.json"
GIB = 2**30


def _plan(capsys, *overrides):
    sets = [a for o in overrides for a in ("--set", o)]
    argv = ["plan", "examples/fsdp_1node_8gpu.yaml", "--nodes", "2", "--gpus-per-node", "8"]
    assert main([*argv, "--hf-config", QWEN3_30B, *sets]) == 0
    return capsys.readouterr().out.splitlines()


def _row(lines, label):
    """The values of the last row named ``label`` (``total`` ends both tables)."""
    return [line.split()[1:] for line in lines if line.strip().startswith(label + " ")][-1]


def test_qwen3_30b_a3b_at_ep8_on_two_nodes_matches_hand_arithmetic(capsys):
    lines = _plan(capsys, "distributed.expert_parallel_size=8")
    d, layers, experts, hidden, vocab = 2048, 48, 128, 768, 151936
    x = layers * 3 * experts * d * hidden  # routed experts: 28,991,029,248
    attention = 2 * d * 32 * 128 + 2 * d * 4 * 128  # q, o and k, v at head_dim 128
    dense = layers * (attention + 2 * d + d * experts) + 2 * vocab * d + d
    assert (x, dense) == (28_991_029_248, 1_541_081_088)
    active = dense + layers * 8 * 3 * d * hidden
    assert f"{(dense + x) / 1e6:,.1f}M parameters: {dense / 1e6:,.1f}M dense" in "\n".join(lines)
    assert f"top-8: {active / 1e6:,.1f}M active per token" in "\n".join(lines)  # A3B: 3.35B
    # fp32 weights: dense over 16 ranks, experts 1/8 per ep rank over efsdp 2 -> x / 16 too
    b = format_bytes
    assert _row(lines, "parameters") == [
        *b(4 * dense // 16).split(),
        *b(4 * x // 16).split(),
        *b(4 * dense // 16 + 4 * x // 16).split(),
    ]
    memory_total = [line for line in lines if line.strip().startswith("total ")][0].split()[1:]
    assert (
        memory_total[2:4] == b(16 * x // 16 + 2 * 2 * (x // 48 // 8) + 4 * (x // 48 // 8)).split()
    )
    assert _row(lines, "optimizer")[2:4] == b(8 * x // 16).split()  # 13.5 GiB of AdamW moments
    unit = x // layers // 8  # one layer's eighth, gathered in bf16 twice, reduced in fp32
    assert _row(lines, "transient")[2:4] == b(2 * 2 * unit + 4 * unit).split()
    # 4 rows x 2 accumulation x 2048 tokens per rank; each (token, expert) pair carries d
    # bf16 values there and back, forward and backward; 7/8 leave the rank
    tokens = 4 * 2 * 2048
    a2a = 4 * layers * tokens * 8 * d * 2 * 7 // 8
    gather_ep, gather_fsdp = 2 * 2 * (x // 8) * 2 // 2, 2 * 2 * x * 2 * 15 // 16
    reduce_ep, reduce_fsdp = (x // 8) * 4 // 2, x * 4 * 15 // 16  # fsdp_reduce_dtype fp32
    assert f"({tokens:,} tokens routed per rank, top-8, 2 micro-batch(es))" in "\n".join(lines)
    assert _row(lines, "all-to-all") == [*b(a2a).split(), "0", "B"]
    assert _row(lines, "all-gather") == [*b(gather_ep).split(), *b(gather_fsdp).split()]
    assert _row(lines, "reduce-scatter") == [*b(reduce_ep).split(), *b(reduce_fsdp).split()]
    total_ep, total_fsdp = a2a + gather_ep + reduce_ep, gather_fsdp + reduce_fsdp
    assert (round(total_ep / GIB, 1), round(total_fsdp / GIB, 1)) == (104.2, 303.8)
    assert _row(lines, "total")[-4:] == [*b(total_ep).split(), *b(total_fsdp).split()]


def test_without_ep_only_the_fsdp_column_and_experts_sharded_whole(capsys):
    lines = _plan(capsys)
    assert "experts split over ep=1 x efsdp=16" in "\n".join(lines)
    assert _row(lines, "all-to-all") == ["0", "B"]
    x = 48 * 3 * 128 * 2048 * 768
    unit = x // 48  # every expert of a layer gathered
    assert _row(lines, "transient")[2:4] == format_bytes(2 * 2 * unit + 4 * unit).split()


def test_ep_not_dividing_the_experts_or_dense_config_is_refused(capsys, tmp_path):
    shape = ExpertShape(moe_layers=1, num_experts=6, top_k=2, dim=8, expert_hidden=4)
    from ray_fsdp_backend.planning.memory import estimate_expert_memory
    from ray_fsdp_backend.settings.config import ShardingStrategy

    with pytest.raises(ValueError, match="expert_parallel_size=4 must divide .* expert count 6"):
        estimate_expert_memory(shape, ShardingStrategy.FULL_SHARD, 8, 4)
    assert moe_model_from_hf({"hidden_size": 8, "num_experts": 0}) is None


def test_traffic_formulas_at_ep_one_and_full_ep():
    shape = ExpertShape(moe_layers=2, num_experts=4, top_k=2, dim=8, expert_hidden=4)
    t = estimate_expert_traffic(shape, 10, ep=4, shard_size=4, value_bytes=4, reduce_bytes=4)
    assert t.all_to_all == 4 * 2 * 10 * 2 * 8 * 4 * 3 // 4
    assert t.all_gather == t.reduce_scatter == 0  # one rank per efsdp group: nothing to gather
    t = estimate_expert_traffic(shape, 10, ep=1, shard_size=4, micro_batches=3)
    assert t.all_to_all == 0
    assert t.all_gather == 3 * 2 * shape.params * 2 * 3 // 4
    assert t.reduce_scatter == shape.params * 2 * 3 // 4


MIXTRAL_8X7B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
)
DEEPSEEK_V3 = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    vocab_size=129280,
)


@pytest.mark.parametrize(
    "hf, total, active, moe_layers",
    [(MIXTRAL_8X7B, 46.70e9, 12.88e9, 32), (DEEPSEEK_V3, 671.0e9, 37.5e9, 58)],
)
def test_mixtral_and_deepseek_v3_count_to_their_published_sizes(hf, total, active, moe_layers):
    model = moe_model_from_hf(hf)
    assert model.experts.moe_layers == moe_layers
    assert model.num_params == pytest.approx(total, rel=0.01)
    assert model.active_params == pytest.approx(active, rel=0.03)
