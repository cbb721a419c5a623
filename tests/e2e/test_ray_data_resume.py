"""Ray Data inputs keep their position across a resume: the restarted stream
drops the rows the job already read this epoch (a real Ray Data iterator on a
local cluster, order preserved), then the next epoch is read whole."""

from __future__ import annotations

import numpy as np
import pytest

from ray_fsdp_backend.trainer.data.corpus import RayDataBatches

pytestmark = pytest.mark.e2e

ROWS, MICRO = 40, 4


def _dataset(ray):
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ids = np.arange(ROWS)
    return ray.data.from_items([{"tokens": np.full(5, i, dtype=np.int64)} for i in ids])


def _ids(batches: RayDataBatches, n: int) -> list[int]:
    return [int(i) for _ in range(n) for i in batches.next_batch()[0][:, 0]]


def test_resume_reads_the_rest_of_the_epoch_once(ray_local):
    ds = _dataset(ray_local)
    first = RayDataBatches(ds.iterator(), MICRO)
    before = _ids(first, 3)
    state = first.state_dict()
    assert state == {"epoch": 0, "epoch_rows": 3 * MICRO}

    resumed = RayDataBatches(ds.iterator(), MICRO)
    resumed.load_state_dict(state)
    after = _ids(resumed, ROWS // MICRO - 3)
    assert sorted(before + after) == list(range(ROWS))  # every row once

    assert _ids(resumed, 1) == [0, 1, 2, 3]  # the next epoch starts from the top
    assert resumed.state_dict() == {"epoch": 1, "epoch_rows": MICRO}


def test_position_is_counted_over_the_job_so_a_smaller_group_skips_its_share(ray_local):
    # Saved by 2 ranks after 2 micro-batches each (16 rows); resumed on 1 rank.
    resumed = RayDataBatches(_dataset(ray_local).iterator(), MICRO, dp_size=1)
    resumed.load_state_dict({"epoch": 0, "epoch_rows": 16})
    assert _ids(resumed, 1) == [16, 17, 18, 19]
