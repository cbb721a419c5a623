"""PURE elastic planning: the global-batch split, the worker range, HSDP on
unequal nodes (a node lost or back with fewer GPUs), the plan at both ends."""

from __future__ import annotations

import pytest

from ray_fsdp_backend.cli.plan_report import format_elastic_plan
from ray_fsdp_backend.distributed.mesh import resolve_layout
from ray_fsdp_backend.planning.elastic import (
    elastic_world_sizes,
    split_global_batch,
    worker_range,
)
from ray_fsdp_backend.planning.topology import topology_from_node_counts
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.trainer.data.corpus import compute_rank_samples, skipped_batches
from ray_fsdp_backend.trainer.schema.spec import build_spec, check_spec


@pytest.mark.parametrize(
    "global_batch, dp, max_micro, micro, accum",
    [
        (8, 4, 2, 2, 1),
        (8, 2, 2, 2, 2),
        (8, 1, 8, 8, 1),
        (12, 4, 2, 1, 3),  # share 3 > 2: three micro-batches of 1, never a ragged one
        (48, 8, 4, 3, 2),
        (64, 8, 100, 8, 1),
    ],
)
def test_split_keeps_the_global_batch(global_batch, dp, max_micro, micro, accum):
    split = split_global_batch(global_batch, dp, max_micro)
    assert (split.micro_batch_size, split.grad_accum) == (micro, accum)
    assert split.micro_batch_size * split.grad_accum * dp == global_batch
    assert split.micro_batch_size <= max_micro


def test_unsplittable_global_batch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"global_batch_size=8 cannot be split evenly over 3 .*"
                       r"world sizes that work: \[1, 2, 4, 8\]"):  # fmt: skip
        split_global_batch(8, 3, 2)
    with pytest.raises(ValueError, match="dp_size=0 must be a positive int"):
        split_global_batch(8, 0, 2)


def test_one_step_reads_the_same_samples_at_any_world_size():
    """Data position across a resize: every layout of one global batch reads
    the same global samples (position, position + global)."""
    position = 3 * 8
    for dp in (1, 2, 4, 8):
        split = split_global_batch(8, dp, 2)
        read = [
            s
            for micro in range(split.grad_accum)
            for rank in range(dp)
            for s in compute_rank_samples(
                position + micro * split.micro_batch_size * dp, split.micro_batch_size, rank, dp
            )
        ]
        assert sorted(read) == list(range(position, position + 8))


def test_worker_range_and_sizes():
    assert worker_range(4) == (4, 4)
    assert worker_range([2, 4]) == (2, 4)
    for bad in (0, [4, 2], [0, 2], "4", [1, 2, 3], True):
        with pytest.raises(ValueError, match="num_workers="):
            worker_range(bad)
    assert elastic_world_sizes(8, 2, 4) == ([2, 4], [3])


def test_ray_data_resume_skips_the_rows_read_this_epoch():
    # 5 steps of a global batch of 8 were read (at any layout): 40 rows.
    assert skipped_batches(40, 2, 4) == 5  # 4 ranks x 2: 5 micro-batches each
    assert skipped_batches(40, 4, 2) == 5
    assert skipped_batches(40, 2, 2) == 10


def _doc(**train):
    return {
        "distributed": {"use_fsdp": True, "fsdp_sharding_strategy": "hybrid_shard"},
        "model": {"preset": "tiny"},
        "train": {"micro_batch_size": 4, **train},
        "scaling": {"num_workers": [8, 16], "use_gpu": False},
    }


def test_spec_accepts_an_elastic_range_and_checks_the_global_batch():
    spec = build_spec(_doc(global_batch_size=32))
    assert spec.scaling.num_workers == [8, 16]
    assert any("grad_accum is derived" in e for e in check_spec(_doc(global_batch_size=32,
                                                                     grad_accum=2)))  # fmt: skip
    assert any("not a multiple of any worker count" in e
               for e in check_spec(_doc(global_batch_size=17)))  # fmt: skip
    bad = _doc()
    bad["scaling"]["num_workers"] = [4, 2]
    assert any("num_workers=[4, 2]" in e for e in check_spec(bad))


def test_plan_reports_both_ends_and_the_sizes_that_cannot_split():
    spec = build_spec(_doc(global_batch_size=32))
    text = format_elastic_plan(spec, gpus_per_node=8)
    assert "smallest: 8 workers on nodes of [8]" in text
    assert "largest: 16 workers on nodes of [8, 8]" in text
    assert "mesh:     (dp_replicate=1, dp_shard=8)" in text
    assert "mesh:     (dp_replicate=2, dp_shard=8)" in text
    assert "global batch 32 = 16 ranks x 1 micro-batch(es) x 2 samples" in text
    assert "per-GPU memory" in text
    assert "cannot be split over [9, 10, 11, 12, 13, 14, 15] workers" in text


def _hsdp(**kw) -> FSDPSettings:
    return FSDPSettings(use_fsdp=True, fsdp_sharding_strategy="hybrid_shard", **kw)


def test_hsdp_after_losing_a_whole_node_rebuilds_from_the_nodes_left():
    layout = resolve_layout(_hsdp(), topology_from_node_counts([4, 4]))  # was [4, 4, 4]
    assert layout.shape == (2, 4)
    assert layout.groups("dp_shard") == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_hsdp_uneven_nodes_default_refuses_with_the_counts():
    with pytest.raises(ValueError, match=r"got \[4, 4, 2\] workers on 3 nodes.*hsdp_uneven_nodes"):
        resolve_layout(_hsdp(), topology_from_node_counts([4, 4, 2]))


def test_hsdp_uneven_nodes_split_nodes_keeps_shard_groups_inside_nodes():
    topology = topology_from_node_counts([4, 4, 2])
    layout = resolve_layout(_hsdp(hsdp_uneven_nodes="split_nodes"), topology)
    assert layout.axis_names == ("dp_replicate", "dp_shard") and layout.shape == (5, 2)
    for group in layout.groups("dp_shard"):
        assert len({topology.node_rank(r) for r in group}) == 1
    assert sorted(r for g in layout.groups("dp_shard") for r in g) == list(range(10))


def test_hsdp_uneven_nodes_full_shard_falls_back_to_one_axis():
    layout = resolve_layout(
        _hsdp(hsdp_uneven_nodes="full_shard"), topology_from_node_counts([4, 4, 2])
    )
    assert layout.axis_names == ("dp_shard",) and layout.shape == (10,)
    even = resolve_layout(_hsdp(hsdp_uneven_nodes="full_shard"), topology_from_node_counts([4, 4]))
    assert even.shape == (2, 4)  # equal nodes keep HSDP


def test_hsdp_uneven_nodes_is_validated():
    with pytest.raises(ValueError, match="hsdp_uneven_nodes='drop'"):
        _hsdp(hsdp_uneven_nodes="drop")


def test_scaling_config_is_elastic_only_for_a_range():
    from ray_fsdp_backend.cli.main import scaling_config

    elastic = scaling_config(build_spec(_doc(global_batch_size=32)), use_gpu=False)
    assert elastic.num_workers == (8, 16)
    fixed_doc = _doc()
    fixed_doc["scaling"] = {"num_workers": 8, "elastic_resize_monitor_interval_s": 5}
    assert scaling_config(build_spec(fixed_doc), use_gpu=False).num_workers == 8
    doc = _doc()
    doc["scaling"]["elastic_resize_monitor_interval_s"] = 2.0
    assert scaling_config(build_spec(doc), use_gpu=False).elastic_resize_monitor_interval_s == 2.0


def test_elastic_sizes_under_model_parallelism_keep_groups_whole():
    from ray_fsdp_backend.planning.elastic import describe_group_sizes

    # tp 2: only even counts, and the dp size (count / 2) must split the batch of 12.
    assert elastic_world_sizes(12, 2, 8, group=2) == ([2, 4, 6, 8], [3, 5, 7])
    assert elastic_world_sizes(8, 2, 8, group=2) == ([2, 4, 8], [3, 5, 6, 7])
    assert elastic_world_sizes(None, 3, 9, group=4) == ([4, 8], [3, 5, 6, 7, 9])
    assert describe_group_sizes(4, 8, 4) is None
    message = describe_group_sizes(5, 7, 4)
    assert "4 ranks per group, but scaling.num_workers=[5, 7] holds no whole group" in message
    assert "multiples of 4 (e.g. 4, 8)" in message


def test_a_worker_range_without_whole_groups_is_refused_by_validate():
    doc = _doc(global_batch_size=32)
    doc["distributed"]["tensor_parallel_size"] = 2
    doc["scaling"]["num_workers"] = [3, 3]
    # The message names the setting that makes the group, not only the workers.
    named = "distributed.tensor_parallel_size=2 needs 2 ranks per group, but scaling.num_workers=3"
    assert any(named in e for e in check_spec(doc)), check_spec(doc)
    doc["scaling"]["num_workers"] = [2, 6]
    assert not [e for e in check_spec(doc) if "global_batch_size" in e or "group" in e]
    doc["train"]["global_batch_size"] = 3  # dp 1 fits (2 workers), so the range is accepted
    assert not [e for e in check_spec(doc) if "global_batch_size=3" in e]
    doc["scaling"]["num_workers"] = [4, 6]  # dp 2 or 3 at tp 2: only 6 workers split 3
    assert not [e for e in check_spec(doc) if "global_batch_size=3" in e]
    doc["scaling"]["num_workers"] = [4, 5]
    assert any("divided by its tp x cp group of 2" in e for e in check_spec(doc))


def test_plan_warns_of_counts_that_break_a_tp_group():
    doc = _doc(global_batch_size=24)
    assert "cannot be split over [9, 10, 11, 13, 14, 15, 16] workers" in format_elastic_plan(
        build_spec(doc), gpus_per_node=8
    )
    doc["distributed"]["tensor_parallel_size"] = 2  # odd counts break a group; 16 is dp 8
    assert "cannot be split over [9, 10, 11, 13, 14, 15] workers" in format_elastic_plan(
        build_spec(doc), gpus_per_node=8
    )
