"""``rfb.MeshDataConfig``'s pure decisions: which world ranks share a Ray Data
stream, and which runs are refused without it (the streams themselves are
checked end to end in tests/e2e/test_ray_data_mesh.py)."""

from __future__ import annotations

import re

import pytest

from ray_fsdp_backend.distributed.mesh import resolve_layout
from ray_fsdp_backend.planning.topology import topology_from_node_counts
from ray_fsdp_backend.runtime.data_config import check_dataset_split, compute_data_parallel_groups
from ray_fsdp_backend.settings.config import FSDPSettings


def test_ranks_are_grouped_by_their_data_parallel_rank():
    cfg = FSDPSettings(use_fsdp=True, tensor_parallel_size=2)
    layout = resolve_layout(cfg, topology_from_node_counts([4, 4]))
    joined = {r: layout.data_parallel_coordinates(r) for r in range(8)}
    groups = compute_data_parallel_groups(joined)
    assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups == [list(g) for g in layout.groups("tp")]


def test_every_rank_its_own_group_without_model_parallelism():
    assert compute_data_parallel_groups({r: (r, 3) for r in range(3)}) == [[0], [1], [2]]


@pytest.mark.parametrize(
    ("joined", "message"),
    [
        ({0: (0, 2), 1: (0, 1)}, "different dp sizes: [1, 2]"),
        ({0: (0, 2), 1: (2, 2)}, "dp_rank=2 outside [0, 2)"),
        ({0: (0, 2), 1: (0, 2)}, "no rank reads data-parallel shard(s) [1] of 2"),
    ],
)
def test_inconsistent_coordinates_are_refused(joined, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compute_data_parallel_groups(joined)


def test_world_rank_split_is_refused_only_when_ranks_share_a_shard():
    check_dataset_split(("train",), False, dp_size=4, world=4)  # plain data parallelism
    check_dataset_split(("train",), True, dp_size=2, world=4)  # MeshDataConfig
    check_dataset_split((), False, dp_size=2, world=4)  # no dataset split
    with pytest.raises(ValueError) as info:
        check_dataset_split(("train", "val"), False, dp_size=2, world=4)
    message = str(info.value)
    assert "['train', 'val']" in message and "2 data-parallel shards" in message
    assert "dataset_config=ray_fsdp_backend.MeshDataConfig()" in message
