"""Shared fixtures.

Ray: ONE local cluster per pytest process (each ``-n 2`` worker has its own),
started on first use and kept across the test modules that share it:

- ``ray_local`` (module scope): the shared cluster, this process connected to
  it (``ray.init`` done); use it for in-process ``TorchTrainer(...).fit()``
  and Ray Data. Leave it running: do not call ``ray.shutdown()``.
- ``ray_address`` (module scope): the same cluster's address, for a
  subprocess (``ray-fsdp train``) to join as ``RAY_ADDRESS`` instead of
  starting a cluster of its own (``ray_env`` builds that environment).

In a new end-to-end module::

    def test_fit(ray_local, tmp_path):        # in-process Ray Train
        result = TorchTrainer(...).fit()

    def test_command(ray_address, tmp_path):  # a driver in a subprocess joins it
        subprocess.run([sys.executable, "-m", "ray_fsdp_backend.cli", "train", ...],
                       env=ray_env(ray_address), check=True)

A module that needs a fresh or differently shaped cluster asks for neither and
starts (and shuts down) its own.

A test that needs none of them gets no cluster: before it runs, the shared one
is shut down (:func:`pytest_runtest_setup`), so a module that starts its own
(``ray.cluster_utils.Cluster``, ``ray start --head``, a ``ray-fsdp train``
without ``RAY_ADDRESS``, the soak's ``init_ray``) never runs beside it in
the same process; the quick start asks for ``ray_local`` on purpose, to run
its own cluster beside a second one (``tests/e2e/test_quickstart.py``).
Two clusters can still run at once, one per pytest worker (as before): each
keeps its own dashboard, and its workers know which cluster is theirs, so
that Train V2's placement-group cleaner asks its own State API (see
:func:`_start_shared`).

S3: ``s3_server`` (session scope), a moto server on loopback (:func:`moto_server`).
"""

from __future__ import annotations

import contextlib
import os

import pytest

# Tests run with CPU workers; keep Ray's stray warnings about GPUs and metrics quiet.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# No instance-metadata lookups from pyarrow's S3 client in this process or the
# Ray workers it starts (a shared cluster may start before ``s3_server``).
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
# Ray Train's controller polls its workers every 2 s by default and notices a
# finished, failed or killed worker group only at a poll: every fit waited
# about 3 s for nothing (``docs/benchmarks.md``, the test suite's cost). Ray
# hands this variable from the driver's environment to the controller; the
# subprocess drivers (``ray-fsdp train``) inherit it. A poll that outlasts it
# is waited for at the next one (``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S``,
# 10 min, decides when a worker is dead), so no test depends on its value.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Ray Train starts a PreemptionWatcher actor at every worker-group start (one
# more process importing Ray Train, polling every 5 s for a node's drain): no
# cloud preempts the suite's local clusters, and no test drains a node.
# ``ray-fsdp train`` turns it off on a local cluster it starts
# (``quiet_driver_console``); this turns it off for the in-process fits and
# the commands that join the shared cluster too: one process less per group
# start (its CPU is within a loaded machine's noise: 3 fits, the cluster's
# processes took 100 / 105 CPU s without / with it, then 84 / 79).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

#: Logical CPUs of the shared cluster: 4 Train workers plus one for Ray Data tasks.
RAY_CPUS = 5
RAY_FIXTURES = ("ray_local", "ray_address")
_shared: dict[str, str] = {}  # "address" while this process's shared cluster runs


def _start_shared():
    """Start (once) and connect to this process's shared local cluster.

    ``address="local"`` always starts a new cluster, so a cluster left behind by
    another run on this machine is never joined by mistake. Train V2's
    placement-group cleaner asks the State API whether the controller is
    alive: the dashboard stays on to answer, and the workers pin
    ``RAY_ADDRESS`` to this cluster (:mod:`ray_fsdp_backend.runtime.ray_start`), or
    the cleaner may ask the other pytest worker's cluster, hear "no such
    actor" and remove this run's placement group (Ray 2.60).
    """
    import ray

    from ray_fsdp_backend.runtime.ray_start import init_ray

    if "address" not in _shared or not ray.is_initialized():
        _stop_shared()
        context = init_ray("local", num_cpus=RAY_CPUS, include_dashboard=True, log_to_driver=False)
        _shared["address"] = context.address_info["address"]
    return ray


def _stop_shared() -> None:
    if _shared.pop("address", None) is not None:
        import ray

        ray.shutdown()


#: The layers in the order their modules go to the pytest-xdist workers
#: (``-n 2 --dist loadfile``): the end-to-end modules (a few tests of minutes
#: each) first, the unit layer (many modules of seconds) last, so that both
#: workers end on short modules.
LAYER_ORDER = ("e2e", "dist", "unit")


def pytest_configure(config):
    """Hand modules to the xdist workers in :data:`LAYER_ORDER`. xdist's
    default (``--loadscope-reorder``) sorts modules by their number of tests,
    most first: the one-test end-to-end modules of minutes (elastic, the
    soak, job submission) went last, one worker running one of them while
    the other had nothing left to run."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """Items by layer (:data:`LAYER_ORDER`); in a layer, the modules that use
    the shared cluster (:data:`RAY_FIXTURES`) before those that do not, so
    that each xdist worker starts its shared cluster once and stops it once
    (in the order collected, the end-to-end layer switched back from a
    module with a cluster of its own to a sharing one 5 times, and a worker
    taking both restarted the shared cluster there); otherwise modules, and
    each module's tests, in the order collected."""
    sharing = {item.path for item in items if set(RAY_FIXTURES) & set(item.fixturenames)}

    def order(item) -> tuple[int, bool]:
        parts = item.nodeid.split("/")
        layer = LAYER_ORDER.index(parts[1]) if parts[1:2] and parts[1] in LAYER_ORDER else 3
        return layer, item.path not in sharing

    items.sort(key=order)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Shut the shared cluster down before a test that does not ask for it."""
    if _shared and not set(RAY_FIXTURES) & set(item.fixturenames):
        _stop_shared()


@pytest.fixture(autouse=True, scope="module")
def _no_context_across_modules():
    """A module that built a ``TrainContext`` in the pytest process leaves none
    behind for the next module (the layer order runs dist modules before unit
    ones in one xdist worker: ``get_context()`` outside a worker must fail)."""
    yield
    from ray_fsdp_backend.runtime.context import set_context

    set_context(None)


def pytest_sessionfinish(session):
    _stop_shared()


@pytest.fixture(scope="module")
def ray_local():
    """This process's shared local Ray cluster, connected (see the module docstring)."""
    return _start_shared()


@pytest.fixture(scope="module")
def ray_address() -> str:
    """The shared cluster's address, for a subprocess's ``RAY_ADDRESS``."""
    _start_shared()
    return _shared["address"]


def ray_env(address: str | None, **extra: str) -> dict[str, str]:
    """``os.environ`` for a subprocess driver: ``RAY_ADDRESS`` set to ``address``
    (the shared cluster, joined), or removed when ``None`` (the subprocess starts
    its own cluster, never a stale one), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address is not None:
        env["RAY_ADDRESS"] = address
    return {**env, **extra}


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
