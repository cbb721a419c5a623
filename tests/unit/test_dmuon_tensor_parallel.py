"""DMuon under TP, the pure parts: TP block shapes and what ``plan`` reports
(the numbers against torch's Muon: tests/dist/test_dmuon_model_parallel.py)."""

from __future__ import annotations

from ray_fsdp_backend.dmuon.report import format_tp_traffic
from ray_fsdp_backend.dmuon.tensor_parallel import TensorSplit


def test_block_shapes_follow_the_split_dimension():
    split = TensorSplit(group=None, rank=1, size=2, dims=(0, 1, None))
    assert split.block_shape((128, 32), 0) == (64, 32)  # column-wise layer: rows split
    assert split.block_shape((32, 128), 1) == (32, 64)  # row-wise layer: columns split
    assert split.block_shape((32, 32), 2) == (32, 32)  # replicated over tp


def test_plan_reports_the_blocks_gathered_and_nothing_without_tp():
    assert format_tp_traffic([(1024, 1024)], 1, 4) == []
    (line,) = format_tp_traffic([(1024, 1024)] * 4, 2, 4)
    # 4 Mi elements, half of each matrix gathered, over 4 owners, 2 bytes each
    assert "1.0 MiB per rank per step" in line and "each of the 2 ranks" in line
