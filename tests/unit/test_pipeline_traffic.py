"""The pipeline plan's arithmetic (issue 47): the bytes a step moves per rank,
the part that crosses nodes with PP against FSDP / HSDP without, the stages'
memory and activations in flight. The volumes are checked against a count of
the real sends and collectives in tests/dist/test_pipeline_checkpoint.py."""

from __future__ import annotations

import types

import pytest

from ray_fsdp_backend.planning.pipeline_layout import plan_stages
from ray_fsdp_backend.planning.pipeline_plan import (
    PipelineCluster,
    crossing_boundaries,
    flat_cross_node,
    format_pipeline_traffic,
    in_flight,
    pipeline_cross_node,
    plan_lines,
    stage_memory,
    stage_params,
)
from ray_fsdp_backend.planning.pipeline_traffic import (
    StageVolumes,
    cross_node_bytes,
    padded_numel,
    stage_volumes,
)


def _cluster(**kw) -> PipelineCluster:
    base = dict(
        nodes=4, ranks_per_node=8, stages=4, tp=1, microbatches=8, schedule="1f1b",
        rows=64, seq_len=2048, dim=8192, micro_batch_size=2,
    )  # fmt: skip
    return PipelineCluster(**{**base, **kw})


def test_padded_numel_rounds_dim0_up_to_the_shards():
    assert padded_numel((5, 3), 2) == 18
    assert padded_numel((4, 3), 2) == 12
    assert padded_numel((), 4) == 4


def test_stage_volumes_count_sends_per_neighbour_and_one_gather():
    first = stage_volumes([100, 20], stage=0, stages=3, activation_values=1000)
    middle = stage_volumes([100, 20], stage=1, stages=3, activation_values=1000)
    assert first == StageVolumes(sends=2000, all_gather=240, reduce_scatter=480)
    assert middle.sends == 4000
    alone = stage_volumes([10], stage=0, stages=1, activation_values=7, gathers=4)
    assert alone == StageVolumes(sends=0, all_gather=80, reduce_scatter=40)


def test_cross_node_moves_a_ring_share_only_when_the_group_spans_nodes():
    volumes = StageVolumes(sends=5, all_gather=800, reduce_scatter=1600)
    assert cross_node_bytes(volumes, shard=8, shard_spans_nodes=True).fsdp == 2100
    assert cross_node_bytes(volumes, shard=8, shard_spans_nodes=False).fsdp == 0
    hsdp = cross_node_bytes(volumes, shard=8, shard_spans_nodes=False, replicas=4)
    assert hsdp.replicate == 2 * 200 * 3 // 4 and hsdp.total == 5 + 300


def test_stage_boundaries_cross_nodes_only_at_node_edges():
    whole_nodes = _cluster()  # 4 stages of one node each
    assert [crossing_boundaries(whole_nodes, s) for s in range(4)] == [1, 2, 2, 1]
    half_nodes = _cluster(nodes=2, stages=4)  # 2 stages per node
    assert [crossing_boundaries(half_nodes, s) for s in range(4)] == [0, 1, 1, 0]


def test_70b_on_4_nodes_pipeline_sends_activations_fsdp_sends_the_model():
    c = _cluster()
    block, embedding, head = 855_654_400, 128_256 * 8192, 128_256 * 8192 + 8192
    plan = plan_stages(80, 4)[1]
    pp = pipeline_cross_node(c, plan.stage, stage_params(plan, block, embedding, head))
    # dp 8 per stage: 8 rows x 2048 x 8192 bf16 each way, nothing else leaves a node.
    assert (pp.sends, pp.fsdp) == (2 * 8 * 2048 * 8192 * 2, 0)
    total = 80 * block + embedding + head
    fsdp = flat_cross_node(c, total, hybrid=False)
    # 2 rows per rank = 1 micro-batch: gathered twice (bf16), reduced once (bf16), 31/32 of each.
    assert fsdp.fsdp == (2 * total * 2 + total * 2) * 31 // 32
    hsdp = flat_cross_node(c, total, hybrid=True)
    assert hsdp.fsdp == 0 and hsdp.replicate == 2 * (total * 2 // 8) * 3 // 4
    assert pp.total * 40 < hsdp.total < fsdp.total


def test_in_flight_gpipe_keeps_every_micro_batch_1f1b_at_most_the_stages_left():
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8] * 4
    assert in_flight("1f1b", 0, 4, 2) == 2


def test_format_names_each_stage_and_the_three_layouts():
    lines = format_pipeline_traffic(_cluster(), 80, 855_654_400, 10**9, 10**9)
    text = "\n".join(lines)
    # balanced: 19, 20, 21, 20 layers; the embedding on stage 0
    assert "stage 0 (layers 0-18 + embedding; 17,257.4M parameters)" in text
    assert "(4 micro-batch(es))" in text and "(1 micro-batch(es))" in text
    assert "stage 3 (layers 60-79 + norm, head; 18,113.1M parameters)" in text
    assert "across nodes per rank per step (4 nodes of 8)" in text
    assert "FSDP over all 32 ranks, no PP" in text and "HSDP (shard in a node)" in text
    assert "tp " not in text  # no tp wording without tp


def test_a_pp_rank_holds_its_stage_unsharded_the_70b_stage_needs_135_gib():
    """Issue 55: the docs' 70B stage 3 (18,163.8M parameters, dp_shard 8, bf16
    compute, fp32 reduction) holds 33.8 GiB of bf16 parameters and 67.7 GiB of
    fp32 gradients unsharded beside its 33.8 GiB sharded state: 135.3 GiB
    before activations, where the old plan printed 33.8 GiB."""
    block, embedding = 855_654_400, 128_256 * 8192
    plan = plan_stages(80, 4)[3]
    params = stage_params(plan, block, embedding, embedding + 8192)
    assert params == 20 * block + embedding + 8192
    mem = stage_memory(params, shard=8, value_bytes=2, reduce_bytes=4)
    gib = 2**30
    assert (mem.params, mem.grads, mem.state) == (2 * params, 4 * params, 2 * params)
    assert round(mem.total / gib, 1) == 135.3
    # tp splits what a rank holds unsharded, and the state over tp x dp_shard
    half = stage_memory(100, tp=2, shard=4, value_bytes=4, reduce_bytes=4)
    assert (half.params, half.grads, half.state) == (200, 200, 200)


def test_plan_lines_read_the_spec_and_skip_unequal_nodes():
    model = types.SimpleNamespace(
        vocab_size=100, dim=8, seq_len=16, n_layers=4,
        block_params=lambda: 500, embedding_params=lambda: 1608,
        activation_shape=lambda rows: None,
    )  # fmt: skip
    distributed = types.SimpleNamespace(
        pipeline_parallel_size=2, pipeline_microbatches=None, pipeline_schedule="gpipe",
        pipeline_virtual_stages=1, pipeline_split=[1, 3], use_gradient_checkpointing=False,
        use_mixed_precision=False, fsdp_reduce_dtype="fp32",
        sharding_strategy=types.SimpleNamespace(reshard_after_forward=True),
    )  # fmt: skip
    train = types.SimpleNamespace(global_batch_size=8, micro_batch_size=1, grad_accum=1)
    spec = types.SimpleNamespace(model=model, distributed=distributed, train=train)
    layout = types.SimpleNamespace(
        axis_names=("pp", "dp_shard"), size=lambda axes: 2, axis_size=lambda axis: 2
    )
    lines = plan_lines(spec, [2, 2], layout)
    # pipeline_split [1, 3]: stage 1 holds 3 blocks and the head
    assert "stage 1 (layers 1-3 + norm, head; 2,308 parameters)" in lines[2]
    assert "(2 micro-batch(es))" in lines[2]
    assert plan_lines(spec, [3, 1], layout) == []


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_more_stages_never_move_more_activation_bytes_per_rank(stages):
    c = _cluster(nodes=8, stages=stages)
    plans = plan_stages(80, stages)
    sends = [pipeline_cross_node(c, p.stage, 1).sends for p in plans]
    assert max(sends) <= 2 * (c.rows // (c.world // stages)) * 2048 * 8192 * 2


def test_checkpoint_param_groups_format_is_read_from_its_keys():
    from ray_fsdp_backend.checkpoint.layout import per_parameter_groups

    nested = ["model.w", "optim.state.w.exp_avg", "optim.param_groups.0.lr"]
    nested.append("optim.param_groups.0.params")
    assert not per_parameter_groups(nested)
    assert per_parameter_groups(["optim.param_groups.layers.0.w.lr", "optim.state.w.step"])
    assert not per_parameter_groups(["model.w"])  # saved without an optimizer
