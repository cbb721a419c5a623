"""Shared fixtures: one local Ray cluster per test module that asks for it."""

from __future__ import annotations

import os

import pytest

# Tests run with CPU workers; keep Ray's stray warnings about GPUs and metrics quiet.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="module")
def ray_local():
    """A fresh local Ray cluster for the module, shut down afterwards.

    ``address="local"`` always starts a new cluster, so a cluster left behind by
    another run on this machine is never joined by mistake. The dashboard stays
    on: Train V2's placement-group cleaner asks the State API whether the
    controller is alive, and without a dashboard of its own that query goes to
    127.0.0.1:8265, where another cluster's dashboard answers "no such actor",
    and the cleaner removes this run's placement group (Ray 2.60).
    """
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=True, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
