"""Retrying storage operations that failed for a transient reason.

Object stores throttle (``503 SlowDown``) and drop connections for seconds;
a checkpoint write that fails for that would fail the run and restart the
whole worker group. :func:`call_with_retries` runs one storage operation
again, with exponential backoff and full jitter (a random wait between 0 and
``min(cap, base * 2**attempt)``, so ranks throttled together do not come
back together), until it succeeds, fails for a reason that waiting cannot
fix, or its time budget is spent; then the last error is raised with the
attempts and seconds spent added to its message.

Why our own loop and not the client's (``pyarrow.fs.S3FileSystem(
retry_strategy=...)``, the AWS SDK's retries): the SDK counts attempts, not
seconds, so no setting both rides out a 10 s outage and bounds a rank's wait
below the collective timeout; it retries each HTTP request, not an upload
whose part failed after its own attempts; its retries are invisible (no
log, no metric); and pyarrow drops a filesystem's ``retry_strategy`` when it
is pickled (apache/arrow#47348, pyarrow 26), which is how Ray hands
``RunConfig(storage_filesystem=...)`` to every worker. The SDK's retries
still run underneath, inside each of our attempts.

Classification reads the error: ``pyarrow`` reports S3 and GCS failures as
``OSError`` whose message names the AWS error (``AWS Error SLOW_DOWN``,
``NETWORK_CONNECTION``, ``HTTP status 503``) or the gRPC-style status of
GCS (``UNAVAILABLE``). Throttling, 5xx, timeouts and connection failures are
transient; access denied, a missing bucket or key, bad credentials and a full
local disk are not, and fail at once; anything unrecognised is not retried.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

_logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_BUDGET_S = 120.0
"""Seconds one storage operation may spend retrying (``storage_retry_s``)."""

_PERMANENT = re.compile(
    r"ACCESS_DENIED|AccessDenied|NO_SUCH_BUCKET|NoSuchBucket|NO_SUCH_KEY|"
    r"INVALID_ACCESS_KEY_ID|InvalidAccessKeyId|SIGNATURE_DOES_NOT_MATCH|"
    r"SignatureDoesNotMatch|EXPIRED_TOKEN|ExpiredToken|INVALID_BUCKET_NAME|"
    r"HTTP status 40[0-4]|PERMISSION_DENIED|UNAUTHENTICATED|NOT_FOUND|"
    r"Bucket '[^']*' not found|No space left|Disk quota"
)
_TRANSIENT = re.compile(
    r"SLOW_DOWN|SlowDown|THROTTLING|Throttl|TOO_MANY_REQUESTS|REQUEST_LIMIT_EXCEEDED|"
    r"SERVICE_UNAVAILABLE|INTERNAL_FAILURE|InternalError|REQUEST_TIMEOUT|RequestTimeout|"
    r"REQUEST_TIME_TOO_SKEWED|NETWORK_CONNECTION|HTTP status (429|5\d\d)|"
    r"curlCode: (6|7|18|28|35|52|55|56)\b|[Cc]onnection (reset|refused|aborted|closed)|"
    r"Empty reply|[Tt]imed? ?out|Broken pipe|UNAVAILABLE|DEADLINE_EXCEEDED|"
    r"RESOURCE_EXHAUSTED|ABORTED"
)
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may go away by itself (throttling, a 5xx answer, a
    timeout, a dropped or refused connection), so the operation is worth
    running again. Missing files, denied access, missing buckets, bad
    credentials and full disks are not."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if not isinstance(exc, OSError):
        return False
    text = str(exc)
    return not _PERMANENT.search(text) and bool(_TRANSIENT.search(text))


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often to retry one operation.

    Args:
        budget_s: seconds the operation may spend from its first attempt
            until it gives up (0: no retries).
        base_s: the first backoff's upper bound; it doubles per attempt.
        cap_s: the largest backoff.
    """

    budget_s: float = DEFAULT_BUDGET_S
    base_s: float = 0.25
    cap_s: float = 10.0

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: a uniform wait up to ``min(cap, base * 2**attempt)``."""
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2.0**attempt))


class RetryStats:
    """Counters of one process: operations that needed retries, the retries
    and the seconds spent waiting and failing before the successful (or last)
    attempt. Thread-safe (async saves retry in a background thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.operations = self.retries = 0
        self.seconds = 0.0

    def add(self, retries: int, seconds: float) -> None:
        with self._lock:
            self.operations += 1
            self.retries += retries
            self.seconds += seconds

    def snapshot(self) -> tuple[int, float]:
        """``(retries, seconds)`` so far."""
        with self._lock:
            return self.retries, self.seconds


STATS = RetryStats()
"""This process's storage retries (read by :class:`~ray_fsdp_backend.metrics.
reporting.StepMeter` as the ``storage_retries`` / ``storage_retry_s`` metrics)."""

_rng = random.Random()


def call_with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    stats: RetryStats = STATS,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``fn()``, run again after transient failures within ``policy.budget_s``.

    An operation that needed retries logs one WARNING when it ends (what,
    the first cause, attempts, seconds) and adds to ``stats``.

    Raises:
        the error of the last attempt: at once when it is not transient,
        otherwise when the next wait would overrun the budget (the message
        then says how many attempts over how many seconds).
    """
    start = clock()
    first: BaseException | None = None
    attempt = 0
    while True:
        try:
            result = fn()
        except Exception as exc:
            if not is_transient(exc):
                _finish(what, first, attempt, clock() - start, stats, ok=False)
                raise
            first = first or exc
            wait = policy.backoff(attempt, _rng)
            spent = clock() - start
            if spent + wait > policy.budget_s:
                _finish(what, first, attempt, spent, stats, ok=False)
                _say_gave_up(exc, attempt + 1, spent, policy.budget_s)
                raise
            _logger.debug("ray_fsdp_backend: %s failed (%s); retrying in %.2f s", what, exc, wait)
            sleep(wait)
            attempt += 1
            continue
        _finish(what, first, attempt, clock() - start, stats, ok=True)
        return result


def _say_gave_up(exc: BaseException, attempts: int, spent: float, budget: float) -> None:
    note = f"gave up after {attempts} attempt(s) over {spent:.1f} s, storage_retry_s={budget:g}"
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} ({note})",)  # in str(exc), which error messages quote
    else:
        exc.add_note(note)


def _finish(what, first, retries, seconds, stats, *, ok: bool) -> None:
    if not retries:
        return
    stats.add(retries, seconds)
    outcome = "succeeded" if ok else "failed"
    _logger.warning(
        "ray_fsdp_backend: %s %s after %d attempt(s) over %.1f s (transient storage error: %s)",
        what,
        outcome,
        retries + 1,
        seconds,
        first,
    )


_DEFAULT = [RetryPolicy()]


def default_policy() -> RetryPolicy:
    """The policy filesystems wrapped in this process get (see
    :func:`set_default_budget`)."""
    return _DEFAULT[0]


def set_default_budget(budget_s: float) -> None:
    """Set this process's retry budget per storage operation; the backend
    calls it on each worker with ``FSDPSettings.storage_retry_s``."""
    _DEFAULT[0] = RetryPolicy(budget_s=float(budget_s))
