"""Shared fixtures: one local Ray cluster per test module that asks for it."""

from __future__ import annotations

import contextlib
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


class S3Server:
    """A real S3 API (moto's standalone server) on a loopback port."""

    def __init__(self, port: int):
        self.port = port
        self.endpoint = f"127.0.0.1:{port}"

    def filesystem(self, **kwargs):
        """A ``pyarrow.fs.S3FileSystem`` on this server, as a user passes it to
        ``RunConfig(storage_filesystem=...)``; it pickles to Ray workers."""
        import pyarrow.fs as pafs

        options = dict(
            endpoint_override=self.endpoint,
            scheme="http",
            access_key="testing",
            secret_key="testing",
            region="us-east-1",
            allow_bucket_creation=True,
        )
        return pafs.S3FileSystem(**{**options, **kwargs})


@contextlib.contextmanager
def moto_server():
    """moto in server mode on a free loopback port (a real HTTP S3 API; the
    clients are the real pyarrow/boto ones), with instance-metadata lookups
    off for this process and the Ray workers it starts; stopped on exit."""
    import socket

    from moto.server import ThreadedMotoServer

    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Server(port)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server for the test session (see :func:`moto_server`)."""
    with moto_server() as server:
        yield server
