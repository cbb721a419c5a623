"""One intra-op thread in the test process while a gloo module runs.

The one-process references these modules train in the test process are as
tiny as the ranks' work (tests/dist/harness.py gives each rank one thread):
a second OpenMP thread speeds none of their ops up, and on 2 cores shared
with the other test worker it spins at every barrier. The count before the
module comes back after it.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
