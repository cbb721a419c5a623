"""Which storage errors are retried, and how: classification of the messages
``pyarrow`` raises (recorded from the real S3 client against moto and the
fault proxy), backoff within the budget on a fake clock, one WARNING per
retried operation, counters."""

from __future__ import annotations

import errno
import logging

import pytest

from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.storage.retry import RetryPolicy, RetryStats, call_with_retries, is_transient

_KEY = "When uploading part for key 'r/checkpoint_000001/__0_0.distcp' in bucket 'b': "
TRANSIENT = [
    _KEY + "AWS Error SLOW_DOWN during CompleteMultipartUpload operation: Please reduce your "
    "request rate. (Request ID: x)",
    _KEY + "AWS Error NETWORK_CONNECTION during UploadPart operation: curlCode: 52, Server "
    "returned nothing (no headers, no data); Details: Empty reply from server",
    "When getting information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION during "
    "HeadObject operation: curlCode: 7, Could not connect to server",
    "When reading information for key 'x' in bucket 'b': AWS Error UNKNOWN (HTTP status 503) "
    "during HeadObject operation: No response body.",
    "AWS Error UNKNOWN (HTTP status 429) during PutObject operation",
    "AWS Error INTERNAL_FAILURE during ListObjectsV2 operation",
    "AWS Error REQUEST_TIMEOUT during UploadPart operation",
    "google::cloud::Status(UNAVAILABLE: connection reset by peer)",
]
PERMANENT = [
    "When initiating multiple part upload for key 'k' in bucket 'b': AWS Error ACCESS_DENIED "
    "during CreateMultipartUpload operation: Access Denied (Request ID: fault-proxy)",
    "AWS Error NO_SUCH_BUCKET during CreateMultipartUpload operation: The specified bucket "
    "does not exist",
    "Bucket 'b' not found. To create buckets, enable the allow_bucket_creation option.",
    "AWS Error INVALID_ACCESS_KEY_ID during PutObject operation",
    "AWS Error UNKNOWN (HTTP status 403) during HeadObject operation: No response body.",
    "something we have never seen",
]


@pytest.mark.parametrize("message", TRANSIENT)
def test_transient_errors(message):
    assert is_transient(OSError(message))


@pytest.mark.parametrize("message", PERMANENT)
def test_permanent_errors(message):
    assert not is_transient(OSError(message))


def test_error_types():
    assert is_transient(ConnectionResetError("reset"))
    assert is_transient(TimeoutError("timed out"))
    assert not is_transient(FileNotFoundError(errno.ENOENT, "gone"))
    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_transient(ValueError("SLOW_DOWN"))  # only I/O errors are retried


class _Clock:
    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def _failing(n: int, message: str = "AWS Error SLOW_DOWN during PutObject"):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= n:
            raise OSError(message)
        return "done"

    return fn, calls


def test_retries_until_success_with_jittered_backoff_and_one_warning(caplog):
    clock, stats = _Clock(), RetryStats()
    fn, calls = _failing(5)
    policy = RetryPolicy(budget_s=60, base_s=1.0, cap_s=4.0)
    with caplog.at_level(logging.WARNING, logger="ray_fsdp_backend.storage.retry"):
        out = call_with_retries(
            fn, what="writing x", policy=policy, stats=stats, sleep=clock.sleep, clock=clock
        )
    assert out == "done" and len(calls) == 6
    # Full jitter: each wait in [0, min(cap, base * 2**attempt)].
    assert all(0 <= w <= min(4.0, 2.0**i) for i, w in enumerate(clock.sleeps))
    assert len(set(clock.sleeps)) == 5
    assert stats.snapshot() == (5, pytest.approx(sum(clock.sleeps)))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "writing x succeeded after 6 attempt(s)" in warnings[0].getMessage()
    assert "SLOW_DOWN" in warnings[0].getMessage()


def test_gives_up_within_the_budget_naming_attempts():
    clock = _Clock()
    fn, calls = _failing(10**6)
    policy = RetryPolicy(budget_s=30, base_s=1.0, cap_s=8.0)
    gave_up = r"gave up after \d+ attempt\(s\) over .*, storage_retry_s=30"
    with pytest.raises(OSError, match=gave_up):
        call_with_retries(
            fn, what="w", policy=policy, stats=RetryStats(), sleep=clock.sleep, clock=clock
        )
    assert clock.now <= 30 and len(calls) > 3


def test_permanent_errors_fail_at_once_and_zero_budget_never_retries():
    clock, stats = _Clock(), RetryStats()
    fn, calls = _failing(1, "AWS Error ACCESS_DENIED during PutObject")
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        call_with_retries(fn, what="w", policy=RetryPolicy(), stats=stats, sleep=clock.sleep)
    fn2, calls2 = _failing(1)
    with pytest.raises(OSError, match="SLOW_DOWN"):
        call_with_retries(fn2, what="w", policy=RetryPolicy(budget_s=0), stats=stats, clock=clock)
    assert len(calls) == len(calls2) == 1 and not clock.sleeps
    assert stats.snapshot() == (0, 0.0)


def test_storage_retry_s_validated_by_key():
    assert FSDPSettings().storage_retry_budget_s == 120
    # A short collective timeout brings the default budget under it, so lowering
    # timeout_s alone never makes a config invalid.
    assert FSDPSettings(timeout_s=10).storage_retry_budget_s == 5
    assert FSDPSettings(timeout_s=10, storage_retry_s=3).storage_retry_budget_s == 3
    with pytest.raises(ValueError, match="storage_retry_s=1800 must be .* below timeout_s=1800"):
        FSDPSettings(storage_retry_s=1800)
    with pytest.raises(ValueError, match="storage_retry_s=-1"):
        FSDPSettings(storage_retry_s=-1)
    assert FSDPSettings.from_dict({"storage_retry_s": 0}).storage_retry_s == 0
