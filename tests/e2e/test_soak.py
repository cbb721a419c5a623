"""The soak's short form (``benchmarks/soak.py``; the long one is 800 steps).

2 CPU workers save asynchronously every 2 steps (16 saves) to the moto S3
server through the fault proxy (10% of checkpoint writes answered ``503
SlowDown``, so pyarrow's client retries run throughout; the backend's own
retry layer sees only what outlasts its 3 attempts): resident memory (the median of the
last quarter of the steps against the second quarter's: 8 saves apart, so a
leak of more than 2 MiB a save fails), descriptors and threads (one leaked
per save fails) stay flat after warm-up, no temporary files remain, and the
store keeps at most ``num_to_keep`` + 1 checkpoints.
"""

from __future__ import annotations

import pytest

from benchmarks import soak

pytestmark = pytest.mark.e2e


def test_async_checkpoints_with_retries_keep_a_flat_footprint():
    out = soak.run(steps=32, every=2, keep=2, throttle=0.1, windows=4)
    print(f"fit {out['fit_s']:.1f} s")
    for row in out["workers"]:
        print(row)
        assert row["rss_flat"] and row["fds_flat"] and row["threads_flat"], row
    assert out["faults_injected"].get("throttle", 0) > 0
    assert out["store_bounded"], out["checkpoints_left"]
    assert out["temporary_files_left"] == []
