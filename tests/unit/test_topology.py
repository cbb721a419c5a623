"""Pure topology and mesh-shape math (no processes)."""

from __future__ import annotations

import pytest

from ray_fsdp_backend import FSDPConfig
from ray_fsdp_backend.distributed.mesh import resolve_layout
from ray_fsdp_backend.planning.topology import (
    TP_AXIS,
    WorkerInfo,
    compute_mesh_layout,
    compute_topology,
    compute_topology_from_env,
    topology_from_node_counts,
)
from ray_fsdp_backend.runtime.backend import resolve_pg_backend
from ray_fsdp_backend.settings.config import ShardingStrategy

HSDP = ShardingStrategy.HYBRID_SHARD


def _cluster(nodes: int, per_node: int):
    return compute_topology(
        [WorkerInfo(world_rank=r, node_id=f"n{r // per_node}") for r in range(nodes * per_node)]
    )


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_hsdp_shards_inside_nodes_and_replicates_across(nodes):
    topo = _cluster(nodes, 8)
    layout = compute_mesh_layout(HSDP, topo)
    assert layout.axis_names == ("dp_replicate", "dp_shard")
    assert layout.shape == (nodes, 8)  # the seed took LOCAL_WORLD_SIZE as the replicate size
    assert layout.groups("dp_shard") == topo.nodes
    for group in layout.groups("dp_replicate"):
        assert [topo.node_rank(r) for r in group] == list(range(nodes))
        assert len({topo.local_rank(r) for r in group}) == 1


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP])
def test_fsdp_is_one_axis_over_all_ranks(strategy):
    layout = compute_mesh_layout(strategy, _cluster(2, 4))
    assert layout.axis_names == ("dp_shard",) and layout.shape == (8,)
    assert layout.groups("dp_shard") == (tuple(range(8)),)
    assert layout.axis_size("dp_replicate") == 1


def test_ddp_is_one_replicate_axis():
    layout = compute_mesh_layout(None, _cluster(2, 2))
    assert layout.axis_names == ("dp_replicate",) and layout.groups("dp_replicate") == (
        (0, 1, 2, 3),
    )


def test_nodes_are_found_by_node_id_even_when_ranks_interleave():
    topo = compute_topology([WorkerInfo(r, node_id="ab"[r % 2]) for r in range(4)])
    assert topo.nodes == ((0, 2), (1, 3))
    assert topo.local_rank(3) == 1 and topo.node_rank(3) == 1
    layout = compute_mesh_layout(HSDP, topo)
    assert layout.groups("dp_shard") == ((0, 2), (1, 3))
    assert layout.groups("dp_replicate") == ((0, 1), (2, 3))


def test_uneven_nodes_refused_for_hsdp_default():
    topo = compute_topology([WorkerInfo(0, "a"), WorkerInfo(1, "a"), WorkerInfo(2, "b")])
    with pytest.raises(
        ValueError, match=r"same number of workers; got \[2, 1\] workers on 2 nodes"
    ):
        compute_mesh_layout(HSDP, topo)
    # Full sharding does not care how workers are spread.
    assert compute_mesh_layout(ShardingStrategy.FULL_SHARD, topo).shape == (3,)


def test_replicate_size_override_and_its_errors():
    topo = _cluster(2, 4)
    layout = compute_mesh_layout(HSDP, topo, replicate_size=4)
    assert layout.shape == (4, 2)
    assert layout.groups("dp_shard") == ((0, 1), (2, 3), (4, 5), (6, 7))
    with pytest.raises(
        ValueError,
        match=r"fsdp_hsdp_replicate_size=3 does not divide the world "
        r"size 8; allowed: \[1, 2, 4, 8\]",
    ):
        compute_mesh_layout(HSDP, topo, replicate_size=3)


def test_bad_ranks_and_env_topology():
    with pytest.raises(ValueError, match="worker ranks must be 0..1"):
        compute_topology([WorkerInfo(0, "a"), WorkerInfo(2, "a")])
    assert compute_topology_from_env(8, 4).nodes == ((0, 1, 2, 3), (4, 5, 6, 7))
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=8"):
        compute_topology_from_env(8, 3)


def test_resolve_layout_reads_config():
    cfg = FSDPConfig(
        use_fsdp=True, fsdp_sharding_strategy="_hybrid_shard_zero2", fsdp_hsdp_replicate_size=2
    )
    assert resolve_layout(cfg, _cluster(1, 4)).shape == (2, 2)
    assert resolve_layout(FSDPConfig(), _cluster(1, 4)).axis_names == ("dp_replicate",)


def test_process_group_backend_choice():
    assert resolve_pg_backend(FSDPConfig(), uses_gpu=False) == "gloo"
    assert resolve_pg_backend(FSDPConfig(use_fsdp=True), uses_gpu=True) == "nccl"
    offload = FSDPConfig(use_fsdp=True, fsdp_cpu_offload=True)
    assert resolve_pg_backend(offload, uses_gpu=True) == "cuda:nccl,cpu:gloo"
    assert resolve_pg_backend(FSDPConfig(backend="gloo"), uses_gpu=True) == "gloo"


@pytest.mark.parametrize("use_gpu", [True, False])
def test_offload_keeps_its_cpu_backend_through_a_real_torch_trainer(use_gpu):
    # TorchTrainer assigns torch_config.backend = "nccl" / "gloo" when it is unset.
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    cfg = FSDPConfig(use_fsdp=True, fsdp_cpu_offload=True)
    TorchTrainer(
        lambda c: None,
        torch_config=cfg,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=use_gpu),
    )
    assert cfg.backend == ("nccl" if use_gpu else "gloo")  # what Ray did
    expected = "cuda:nccl,cpu:gloo" if use_gpu else "gloo"
    assert resolve_pg_backend(cfg, uses_gpu=use_gpu) == expected


def test_explicit_replicate_size_may_not_split_a_shard_group_across_nodes():
    topo = _cluster(2, 6)  # 2 nodes x 6 workers; replicate 3 -> groups of 4
    with pytest.raises(ValueError, match=r"dp_shard group \(4, 5, 6, 7\) span nodes \[0, 1\]"):
        compute_mesh_layout(HSDP, topo, replicate_size=3)
    allowed = compute_mesh_layout(HSDP, topo, replicate_size=3, shard_across_nodes=True)
    assert allowed.groups("dp_shard")[1] == (4, 5, 6, 7)
    cfg = FSDPConfig(
        use_fsdp=True,
        fsdp_sharding_strategy="hybrid_shard",
        fsdp_hsdp_replicate_size=3,
        fsdp_hsdp_shard_across_nodes=True,
    )
    assert resolve_layout(cfg, topo).shape == (3, 4)
    assert compute_mesh_layout(HSDP, topo, replicate_size=4).groups("dp_shard")[0] == (0, 1, 2)


# -- model-parallel axes inside the data-parallel ones -------------------

TP2 = ((TP_AXIS, 2),)


def test_tp_is_innermost_neighbouring_ranks_and_dp_coordinates_skip_it():
    layout = compute_mesh_layout(ShardingStrategy.FULL_SHARD, _cluster(1, 4), inner_axes=TP2)
    assert layout.axis_names == ("dp_shard", "tp") and layout.shape == (2, 2)
    assert layout.grid == ((0, 1), (2, 3))
    assert layout.groups("tp") == ((0, 1), (2, 3))
    assert layout.groups("dp_shard") == ((0, 2), (1, 3))
    assert layout.groups(("dp_shard", "tp")) == ((0, 1, 2, 3),)
    assert [layout.data_parallel_coordinates(r) for r in range(4)] == [
        (0, 2),
        (0, 2),
        (1, 2),
        (1, 2),
    ]
    assert layout.coordinates(3) == {"dp_shard": 1, "tp": 1}
    assert layout.axis_size("dp_replicate") == 1 and layout.size(("dp_shard", "tp")) == 4


def test_hsdp_with_tp_is_three_axes_with_shard_and_tp_groups_inside_nodes():
    topo = _cluster(2, 4)
    layout = compute_mesh_layout(HSDP, topo, inner_axes=TP2)
    assert layout.axis_names == ("dp_replicate", "dp_shard", "tp")
    assert layout.shape == (2, 2, 2)
    assert layout.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.groups("dp_shard") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.groups("dp_replicate") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.data_parallel_coordinates(5) == (2, 4)  # replica 1, shard 0
    # HSDP 2 x (1 x 2) on one node of 4: an explicit replicate size.
    small = compute_mesh_layout(HSDP, _cluster(1, 4), replicate_size=2, inner_axes=TP2)
    assert small.shape == (2, 1, 2) and small.groups("dp_replicate") == ((0, 2), (1, 3))
    assert [small.data_parallel_coordinates(r)[0] for r in range(4)] == [0, 0, 1, 1]


def test_size_one_inner_axes_leave_the_layout_unchanged():
    for strategy in (None, ShardingStrategy.FULL_SHARD, HSDP):
        before = compute_mesh_layout(strategy, _cluster(2, 4))
        after = compute_mesh_layout(strategy, _cluster(2, 4), inner_axes=((TP_AXIS, 1),))
        assert before == after
        for rank in range(8):  # dp coordinates: the flat position, as before
            assert before.data_parallel_coordinates(rank) == (before.ranks.index(rank), 8)


def test_tp_groups_follow_node_ids_not_rank_numbers():
    topo = compute_topology([WorkerInfo(r, node_id="ab"[r % 2]) for r in range(8)])
    layout = compute_mesh_layout(HSDP, topo, inner_axes=TP2)
    assert layout.groups("tp") == ((0, 2), (4, 6), (1, 3), (5, 7))
    for group in layout.groups("tp") + layout.groups("dp_shard"):
        assert len({topo.node_rank(r) for r in group}) == 1


def test_any_inner_axes_list_lays_out_outermost_first():
    layout = compute_mesh_layout(
        ShardingStrategy.FULL_SHARD, _cluster(1, 8), inner_axes=(("cp", 2), ("tp", 2))
    )
    assert layout.axis_names == ("dp_shard", "cp", "tp") and layout.shape == (2, 2, 2)
    assert layout.groups("cp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.groups(("dp_shard", "cp")) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert layout.data_parallel_coordinates(6) == (1, 2)


def test_tp_that_does_not_tile_every_node_is_refused_with_the_counts():
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=4 needs groups of 4 ranks inside "
        r"one node, but the nodes run \[8, 6\] workers",
    ):
        compute_mesh_layout(HSDP, topology_from_node_counts([8, 6]), inner_axes=((TP_AXIS, 4),))
    with pytest.raises(ValueError, match=r"does not divide the data-parallel size \(world / 2\) 4"):
        compute_mesh_layout(HSDP, _cluster(2, 4), replicate_size=3, inner_axes=TP2)
    # Unequal nodes that tp divides: split_nodes shards over gcd blocks of tp groups.
    layout = compute_mesh_layout(
        HSDP, topology_from_node_counts([4, 2]), uneven_nodes="split_nodes", inner_axes=TP2
    )
    assert layout.shape == (3, 1, 2) and layout.groups("tp") == ((0, 1), (2, 3), (4, 5))


def test_resolve_layout_reads_tensor_parallel_size():
    cfg = FSDPConfig(use_fsdp=True, tensor_parallel_size=2)
    assert resolve_layout(cfg, _cluster(1, 4)).axis_names == ("dp_shard", "tp")
    hsdp = FSDPConfig(use_fsdp=True, fsdp_sharding_strategy="hybrid_shard", tensor_parallel_size=4)
    assert resolve_layout(hsdp, _cluster(2, 8)).shape == (2, 2, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs groups of 4"):
        resolve_layout(hsdp, _cluster(2, 2))
