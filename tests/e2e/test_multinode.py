"""A fake 2-node cluster (ray.cluster_utils.Cluster): HSDP groups follow nodes."""

from __future__ import annotations

import collections

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

import ray_fsdp_backend as rfb
from ray_fsdp_backend.runtime.ray_start import init_ray
from tests.e2e.train_fns import reference_toy, train_toy

pytestmark = pytest.mark.e2e

STEPS = 2


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    init_ray(cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _trainer(num_workers: int, batch: int = 16, **cfg) -> TorchTrainer:
    return TorchTrainer(
        train_toy,
        train_loop_config={"steps": STEPS, "batch": batch},
        torch_config=rfb.FSDPConfig(use_fsdp=True, use_mixed_precision=False, **cfg),
        scaling_config=ScalingConfig(num_workers=num_workers),
    )


def test_hsdp_shard_groups_stay_inside_a_node(two_nodes):
    out = _trainer(4, fsdp_sharding_strategy="hybrid_shard").fit().return_value
    node_of = {r["rank"]: r["node_id"] for r in out["ranks"]}
    assert len(set(node_of.values())) == 2
    for r in out["ranks"]:
        shard, replicate = r["groups"]["dp_shard"], r["groups"]["dp_replicate"]
        assert len(shard) == 2 and {node_of[x] for x in shard} == {node_of[r["rank"]]}
        assert len(replicate) == 2 and len({node_of[x] for x in replicate}) == 2
    for name, value in reference_toy(STEPS).items():
        torch.testing.assert_close(torch.tensor(out["params"][name]), value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["split_nodes", "full_shard"])
def test_uneven_nodes_policy_trains_like_one_process(two_nodes, policy):
    """3 workers on nodes of [2, 1] (a node back with fewer GPUs)."""
    cfg = {"fsdp_sharding_strategy": "hybrid_shard", "hsdp_uneven_nodes": policy}
    out = _trainer(3, batch=15, **cfg).fit().return_value
    node_of = {r["rank"]: r["node_id"] for r in out["ranks"]}
    assert sorted(collections.Counter(node_of.values()).values()) == [1, 2]
    for r in out["ranks"]:
        if policy == "full_shard":  # one shard group over both nodes
            assert list(r["groups"]) == ["dp_shard"] and len(r["groups"]["dp_shard"]) == 3
        else:  # gcd(2, 1) = 1: shard groups of one rank, inside a node
            assert r["groups"]["dp_shard"] == [r["rank"]]
            assert len(r["groups"]["dp_replicate"]) == 3
    for name, value in reference_toy(STEPS, batch=15).items():
        torch.testing.assert_close(torch.tensor(out["params"][name]), value, atol=1e-5, rtol=1e-5)


def test_uneven_nodes_fail_at_start_with_a_clear_error(two_nodes):
    with pytest.raises(Exception, match="same number of workers; got \\[2, 1\\]"):
        _trainer(3, fsdp_sharding_strategy="hybrid_shard").fit()
