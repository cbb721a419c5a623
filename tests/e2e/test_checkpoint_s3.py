"""Checkpoints on a real S3 API (moto server on loopback, passed to Ray as
``RunConfig(storage_filesystem=...)``), 2 CPU workers, full_shard.

One module, one Ray session, four fits (6 worker-group starts): the
reference, with asynchronous saves through :mod:`tests.fault_proxy`, 25% of
checkpoint writes answered ``503 SlowDown`` and a 4 s outage from the first
checkpoint write on (one attempt: transient faults cost retries, no
restart); the same job with a failed background write and a worker killed
right after the last save returned, its write in flight (it must end with
the reference's parameters, restore reading at most 1.2x the checkpoint,
keep at most ``num_to_keep`` + 1 complete checkpoints); and a run with
synchronous saves whose S3 server goes away mid-save (past
``storage_retry_s`` the error names the store), resumed later by one
worker, which must restore the two workers' checkpoint exactly. Resharding
4 -> 2 ranks, ranged reads at 4 ranks and what an asynchronous save writes
are ``tests/dist/test_checkpoint_s3.py``'s; this module holds what Ray adds:
its restarts, the checkpoints it hands and registers, and its controller's
own writes to a misbehaving store.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import ray_fsdp_backend as rfb
from ray_fsdp_backend.checkpoint import CheckpointStore
from ray_fsdp_backend.checkpoint.layout import decode_marker
from tests import counting_fs
from tests.conftest import S3Server
from tests.e2e.ckpt_s3_fns import train_on_store
from tests.fault_proxy import FaultProxy

pytestmark = pytest.mark.e2e

STEPS, EVERY, KEEP = 8, 2, 1
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
FSDP = rfb.FSDPConfig(use_fsdp=True, use_mixed_precision=False)
BUCKET = "e2e-ckpt"
OUTAGE_S = 4.0  # 16x the first retry backoff (0.25 s): several retries ride it out
FAULTS = [
    # Rank 1's background write of the step-4 checkpoint fails: step 2 resumes.
    {"rank": 1, "step": 4, "where": "async_write_fail"},
    # Killed right after the last save returned, its write still in flight.
    {"rank": 1, "step": 8, "where": "after_save"},
]


def _fit(
    tmp_path, fs, name: str, faults: list, *, workers=2, max_failures=None, fsdp=FSDP, **config
):
    fault_dir = tmp_path / f"{name}_faults"
    fault_dir.mkdir(exist_ok=True)
    trainer = TorchTrainer(
        train_on_store,
        train_loop_config={
            "steps": STEPS,
            "every": EVERY,
            "fault_dir": str(fault_dir),
            "faults": faults,
            **config,
        },
        torch_config=fsdp,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name=name,
            storage_path=f"{BUCKET}/runs",
            storage_filesystem=fs,
            failure_config=FailureConfig(
                max_failures=len(faults) + 1 if max_failures is None else max_failures
            ),
            checkpoint_config=CheckpointConfig(num_to_keep=KEEP),
        ),
    )
    return trainer.fit(), fault_dir


def _attempts(fault_dir: Path) -> list[dict]:
    paths = sorted(fault_dir.glob("attempt_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(p.read_text()) for p in paths]


def _restore_reads(fault_dir: Path) -> dict[int, int]:
    """Attempt -> bytes all ranks read while restoring."""
    totals: dict[int, int] = {}
    for p in fault_dir.glob("read_*.json"):
        attempt = int(p.stem.split("_")[1])
        totals[attempt] = totals.get(attempt, 0) + json.loads(p.read_text())["bytes"]
    return totals


@pytest.fixture(scope="module")
def runs(s3_server, ray_local, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ckpt_s3")
    s3 = s3_server.filesystem()
    s3.create_dir(BUCKET)
    proxy = FaultProxy(s3_server.port)
    proxy.throttle(0.25, seed=1)  # of checkpoint writes
    proxy.outage(OUTAGE_S)  # from the first checkpoint write on: connections closed unanswered
    try:
        # One restart to spare, so that a regression fails its test, not the fixture.
        throttled = _fit(
            tmp_path, S3Server(proxy.port).filesystem(), "throttled", [], max_failures=1,
            async_save=True,
        )  # fmt: skip
    finally:
        proxy.close()
    fs = counting_fs.counting(s3)
    faulted = _fit(tmp_path, fs, "faulted", FAULTS, async_save=True)
    return s3, (throttled, dict(proxy.injected)), faulted


@pytest.fixture(scope="module")
def gone(ray_local, tmp_path_factory):
    """A run whose S3 server goes away before the step-4 save (no restart
    allowed, ``storage_retry_s=3``): its error; then, the server back, the
    run resumed by one worker. Returns the error, the result and the attempts."""
    from moto.server import ThreadedMotoServer

    tmp_path = tmp_path_factory.mktemp("ckpt_s3_gone")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = S3Server(port).filesystem()
    s3.create_dir(BUCKET)
    fault_dir = tmp_path / "gone_faults"
    fault_dir.mkdir()
    stopper = threading.Thread(target=_stop_when_asked, args=(server, fault_dir), daemon=True)
    stopper.start()
    faults = [{"rank": 0, "step": 4, "where": "server_gone"}]
    endpoint = f"127.0.0.1:{port}"
    # The server stays gone: the writes give up after storage_retry_s.
    fsdp = rfb.FSDPConfig(use_fsdp=True, use_mixed_precision=False, storage_retry_s=3)
    try:
        with pytest.raises(Exception) as info:
            _fit(tmp_path, s3, "gone", faults, max_failures=0, fsdp=fsdp, endpoint=endpoint,
                 params_at=EVERY)  # fmt: skip
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        result, _ = _fit(tmp_path, s3, "gone", faults, workers=1, endpoint=endpoint,
                         record_restored=True)  # fmt: skip
    finally:
        server.stop()
    return str(info.value), result, _attempts(fault_dir)


def test_async_run_with_kills_ends_equal_to_uninterrupted_run_reading_only_its_ranges(runs):
    s3, ((reference, _), _), (faulted, fault_dir) = runs
    attempts = _attempts(fault_dir)
    print("resumed from, per attempt:", [a["resumed_from"] for a in attempts])
    # The failed step-4 write left step 2 the checkpoint restored.
    assert attempts[1]["resumed_from"] == 2
    assert len(attempts) == len(FAULTS) + 1
    # The kill after the last save lost its in-flight write: steps 7 and 8 ran again.
    assert attempts[-1]["resumed_from"] < STEPS, attempts
    for name, value in reference.return_value["params"].items():
        got = torch.tensor(faulted.return_value["params"][name])
        assert torch.equal(got, torch.tensor(value)), name
    # Bytes every rank read from S3 per restore, against the checkpoint's size.
    root = f"{BUCKET}/runs/faulted"
    size = counting_fs.tree_size(s3, f"{root}/{Path(faulted.checkpoint.path).name}")
    reads = {a: r for a, r in sorted(_restore_reads(fault_dir).items()) if r > 0}
    print(f"checkpoint {size} B; restore reads at 2 ranks: {reads}")
    assert reads and all(r <= 1.2 * size for r in reads.values()), (reads, size)
    # Retention over the whole store, registered or not: the kills leave
    # complete checkpoints Ray never registers and half-written ones.
    store = CheckpointStore(s3, root)
    markers = store.read_markers()
    complete = [n for n, text in markers.items() if decode_marker(text)]
    print("checkpoints in the store:", markers, "Ray's:", store.read_text(RAY_SNAPSHOT))
    assert len(complete) <= KEEP + 1, markers
    # Debris of killed writers goes when the next worker group starts.
    assert len(markers) - len(complete) <= 1, markers


def test_server_gone_mid_save_fails_naming_the_store_then_resumes(gone):
    message, result, attempts = gone
    print("error:", message[-600:])
    assert f"s3://{BUCKET}/runs/gone" in message
    assert "testing" not in message  # the access and secret keys
    assert "gave up after" in message and "storage_retry_s=3" in message
    assert attempts[-1]["resumed_from"] == EVERY
    assert result.metrics["step"] == STEPS


def test_one_worker_resumes_the_two_worker_checkpoint_exactly(gone):
    """The resumed run's one worker restores what the two workers had
    trained at the step-2 checkpoint (reading only the store: the test
    never hands it the checkpoint)."""
    _, _, attempts = gone
    before, after = attempts[0], attempts[-1]
    assert (before["world_size"], after["world_size"]) == (2, 1)
    assert sorted(after["restored"]) == sorted(before["params_at"])
    for name, value in before["params_at"].items():
        assert torch.equal(torch.tensor(after["restored"][name]), torch.tensor(value)), name


def test_throttled_store_and_a_4s_outage_cost_no_restart(runs):
    """The reference run's store answered 503 to a quarter of the checkpoint
    writes and dropped every connection for OUTAGE_S: one attempt, retries
    on rank 0 (its parameters are the other tests' reference)."""
    _, ((result, fault_dir), injected), _ = runs
    print("faults injected:", injected, "retries on rank 0:", result.return_value["retries"])
    assert injected.get("throttle", 0) >= 3 and injected.get("outage", 0) >= 2
    assert len(_attempts(fault_dir)) == 1 and result.return_value["retries"] > 0
    assert result.metrics["step"] == STEPS


def _stop_when_asked(server, fault_dir: Path) -> None:
    while not (fault_dir / "stop_server").exists():
        time.sleep(0.05)
    server.stop()
