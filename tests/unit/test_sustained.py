"""The sustained benchmark's pure parts: idle time between kernels, windows."""

from __future__ import annotations

import pytest

from benchmarks.sustained import compute_gpu_idle, profiled_step, windows


def test_idle_is_the_span_minus_the_union_of_kernels():
    kernels = [
        (0.0, 100.0, "gemm"),
        (50.0, 120.0, "copy"),  # overlaps gemm: busy 0-120
        (150.0, 200.0, "norm"),  # 30 us gap after copy
        (260.0, 300.0, "adamw"),  # 60 us gap after norm
        (270.0, 280.0, "tiny"),  # inside adamw
    ]
    idle = compute_gpu_idle(kernels)
    assert idle["span_ms"] == pytest.approx(0.300)
    assert idle["busy_ms"] == pytest.approx(0.210)
    assert idle["idle_ms"] == pytest.approx(0.090)
    assert idle["idle_pct_of_span"] == pytest.approx(30.0)
    assert idle["longest_gaps"] == [{"us": 60.0, "after": "norm"}, {"us": 30.0, "after": "copy"}]
    assert compute_gpu_idle([]) is None


def test_windows_and_the_profiled_step():
    assert windows(200) == {"early": (10, 30), "late": (150, 200)}
    assert windows(40) == {"early": (10, 30), "late": (30, 40)}
    assert profiled_step(200, 10) == 185
    assert profiled_step(25, 10) == 9  # a step that does not log
