"""Sharded checkpoints on a store that misbehaves: the real moto S3 server
behind :mod:`tests.fault_proxy`, the real ``pyarrow`` client, 2 gloo ranks,
one spawn running every scenario in turn.

Transient faults (a 25% ``503 SlowDown`` storm on sync and async saves, a
2 s outage during a save, during the listing and during the restore's reads,
an upload cut mid-body) cost retries only: each save and load succeeds and
what is loaded equals, bit for bit, what was saved. Past the budget the
save fails naming the store and leaves the previous checkpoint the newest
complete one, which loads exactly. A 403 and a missing bucket fail in
seconds, without spending the budget, naming the store and the cause.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ray_fsdp_backend.checkpoint import CheckpointStore, find_latest, load_sharded, save_sharded
from ray_fsdp_backend.checkpoint.layout import extra_state_name
from ray_fsdp_backend.checkpoint.sharded import AsyncCheckpointer, CheckpointStorageError
from ray_fsdp_backend.storage import retry
from ray_fsdp_backend.storage.retry import RetryPolicy
from ray_fsdp_backend.storage.retrying_fs import with_retries
from tests.dist.test_checkpoint import FSDP, _assert_states_equal, _full_state, _step, _wrap
from tests.fault_proxy import LISTING, READS, SDK_ATTEMPTS, FaultProxy, RemoteFaults

MODEL = {"dim": 128, "n_layers": 2}
BUCKET = "dist-faults"
OUTAGE_S = 2.0


class _Phases:
    """Runs one scenario on every rank: rank 0 sets the proxy's rules, all
    ranks run ``fn``, and rank 0 records seconds, faults injected, the
    retries of the backend's retry layer on all ranks and the error (a
    ``CheckpointStorageError``'s message), if any."""

    def __init__(self, endpoint: str):
        self.faults = RemoteFaults(endpoint)
        self.log: dict[str, dict] = {}

    def run(self, name: str, rules, fn):
        # Every rank is done with what came before (a listing between two
        # phases) before rank 0 changes the rules.
        dist.barrier()
        if dist.get_rank() == 0:
            self.faults.clear()
            rules(self.faults)
        dist.barrier()
        retries_before = retry.STATS.snapshot()[0]
        start, out, error = time.monotonic(), None, None
        try:
            out = fn()
        except CheckpointStorageError as exc:
            error = str(exc)
        seconds = time.monotonic() - start
        retries = [0] * dist.get_world_size()
        dist.all_gather_object(retries, retry.STATS.snapshot()[0] - retries_before)
        if dist.get_rank() == 0:
            injected = self.faults.injected()
            self.faults.clear()
            self.log[name] = {
                "seconds": seconds,
                "injected": injected,
                "retries": sum(retries),
                "error": error,
            }
        dist.barrier()  # the rules are cleared before any rank goes on
        return out


TORN = {2: "__0_0.distcp", 3: ".metadata", 4: extra_state_name(0)}
"""Checkpoint step -> the file cut to half its size (rank 0 reads each)."""


def _past_sdk(world_size: int) -> int:
    """Drops that outlast the client's own attempts: each rank's first call
    makes at most ``SDK_ATTEMPTS`` before it fails, so the outage reaches the
    backend's retry layer whatever the timing. (A 2 s outage alone did not:
    on a loaded machine the client's three attempts outlasted it.)"""
    return world_size * SDK_ATTEMPTS + 1


def _tear(store, path):
    data = store.read_file(path)
    store.write_file(path, data[: len(data) // 2])


def _fresh_load(store, name, rank):
    torch.manual_seed(77)  # another init: the load must overwrite it
    model, opt = _wrap(FSDP, rank, **MODEL)
    load_sharded(store, name, model, opt)
    return _full_state(model, opt)


def _scenarios(rank, world_size, s3, root, endpoint):
    phases = _Phases(endpoint)
    store = CheckpointStore(with_retries(s3, RetryPolicy(budget_s=60)), root)
    model, opt = _wrap(FSDP, rank, **MODEL)
    saver = AsyncCheckpointer()
    saved = {}

    def save(step):
        _step(model, opt, rank, world_size)
        saved[step] = _full_state(model, opt)
        return save_sharded(store, model, opt, extra_state={"step": step})

    def async_save(step):
        _step(model, opt, rank, world_size)
        saved[step] = _full_state(model, opt)
        pending = saver.start(store, model, opt, extra_state={"step": step})
        _step(model, opt, rank, world_size)  # training moves on during the write
        return pending.wait()

    names = {
        1: phases.run("503 storm, sync save", lambda f: f.throttle(0.25, seed=1), lambda: save(1)),
        2: phases.run(
            "503 storm, async save", lambda f: f.throttle(0.25, seed=1), lambda: async_save(2)
        ),
        3: phases.run("outage during a save", lambda f: f.outage(OUTAGE_S), lambda: save(3)),
        4: phases.run("drop mid-body", lambda f: f.drop_mid_body(count=4), lambda: save(4)),
    }
    listing = phases.run(
        "outage during the listing",
        lambda f: f.outage(OUTAGE_S, methods=READS, pattern=LISTING, drops=_past_sdk(world_size)),
        lambda: find_latest(store),
    )
    loaded = {
        step: phases.run(
            f"outage during restore reads of {step}",
            lambda f: f.outage(OUTAGE_S, methods=READS, drops=_past_sdk(world_size)),
            lambda step=step: _fresh_load(store, names[step], rank),
        )
        for step in (1,)
    }
    loaded.update({step: _fresh_load(store, names[step], rank) for step in (2, 3, 4)})
    # Past the budget: the outage outlasts a 1 s budget.
    short = CheckpointStore(with_retries(s3, RetryPolicy(budget_s=1.0)), root)
    phases.run(
        "past the budget",
        lambda f: f.outage(30.0, count=1000),
        lambda: save_sharded(short, model, opt, extra_state={"step": 5}),
    )
    after_failure = find_latest(store)
    phases.run("403", lambda f: f.deny(), lambda: save(6))
    missing = CheckpointStore(with_retries(s3, RetryPolicy(budget_s=60)), "no-such-bucket-28/run")
    phases.run("missing bucket", lambda f: None, lambda: save_sharded(missing, model, opt))
    saver.close()
    for step, relative in TORN.items():
        path = f"{names[step]}/{relative}"
        phases.run(
            f"torn {relative}",
            lambda f, path=path: _tear(store, path),
            lambda step=step: _fresh_load(store, names[step], rank),
        )
    return phases.log, names, listing, after_failure, saved, loaded


def test_transient_faults_cost_retries_only_and_permanent_ones_fail_fast(s3_server):
    from tests.dist.harness import run_ranks

    s3_server.filesystem().create_dir(BUCKET)
    proxy = FaultProxy(s3_server.port)
    try:
        # No bucket creation: a save must not create the missing bucket.
        s3 = s3_server.filesystem(endpoint_override=proxy.endpoint, allow_bucket_creation=False)
        root = f"{BUCKET}/run"
        log, names, listing, after_failure, saved, loaded = run_ranks(
            _scenarios, 2, s3, root, proxy.endpoint
        )
    finally:
        proxy.close()
    for name, entry in log.items():
        print(f"{name}: {entry['seconds']:.1f} s, injected {entry['injected']}, "
              f"{entry['retries']} retries")  # fmt: skip
    for step, relative in TORN.items():
        error = log[f"torn {relative}"]["error"]
        print(f"torn {relative}: {log[f'torn {relative}']['seconds']:.2f} s: {error[:600]}")
        assert error is not None and f"{names[step]}/{relative} is torn" in error, error
        assert "holds" in error and "bytes" in error, error
        assert log[f"torn {relative}"]["seconds"] < 10.0
    assert "needs at least" in log["torn __0_0.distcp"]["error"]
    transient = [
        n for n in log if n not in ("past the budget", "403", "missing bucket")
        and not n.startswith("torn")
    ]  # fmt: skip
    for name in transient:
        assert log[name]["error"] is None, (name, log[name]["error"])
        assert log[name]["injected"], f"{name}: no fault was injected"
    assert [names[s] for s in (1, 2, 3, 4)] == [f"checkpoint_00000{s}" for s in (1, 2, 3, 4)]
    assert listing == "checkpoint_000004"
    for step in (1, 2, 3, 4):  # every object whole: loads equal the saved state exactly
        _assert_states_equal(loaded[step], saved[step])
    # pyarrow's client retries a 503 or a dropped connection itself (3
    # attempts), so a storm may never reach the backend's layer; an outage of
    # the reads that drops more than those attempts must be retried by it.
    for name in ("outage during the listing", "outage during restore reads of 1"):
        assert log[name]["retries"] > 0, (name, log[name])

    past = log["past the budget"]
    print("past the budget:", past["error"][:400])
    assert f"s3://{root}" in past["error"] and "gave up after" in past["error"]
    assert past["seconds"] < 10.0  # the outage lasts 30 s
    assert after_failure == "checkpoint_000004"  # the failed save never committed
    assert "testing" not in past["error"]  # no credentials in messages
    for name, cause in [
        ("403", "ACCESS_DENIED"),
        ("missing bucket", "Bucket 'no-such-bucket-28' not found"),
    ]:
        error = log[name]["error"]
        print(f"{name}: {log[name]['seconds']:.2f} s: {error[:300]}")
        assert error is not None and cause in error, error
        assert "s3://" in error and "gave up" not in error
        assert log[name]["seconds"] < 10.0, log[name]  # the budget is 60 s
    assert "s3://no-such-bucket-28/run" in log["missing bucket"]["error"]
