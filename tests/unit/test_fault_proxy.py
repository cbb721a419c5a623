"""The fault proxy's outage with ``drops`` (tests/fault_proxy.py): it lasts
until that many requests were dropped, however short its seconds, so the
real ``pyarrow`` client's own attempts cannot outlast it on a loaded machine
(what made tests/dist/test_checkpoint_faults.py flaky)."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from tests.fault_proxy import LISTING, READS, SDK_ATTEMPTS, FaultProxy

BUCKET = "proxy-drops"


@pytest.fixture
def proxy(s3_server):
    s3_server.filesystem().create_dir(f"{BUCKET}/run")
    proxy = FaultProxy(s3_server.port)
    yield proxy
    proxy.close()


def _listing(fs):
    return fs.get_file_info(pafs.FileSelector(f"{BUCKET}/run"))


def test_drops_outlast_the_clients_attempts_however_short_the_outage(s3_server, proxy):
    fs = s3_server.filesystem(endpoint_override=proxy.endpoint)
    proxy.outage(0.01, methods=READS, pattern=LISTING, drops=SDK_ATTEMPTS + 1)
    with pytest.raises(OSError, match="NETWORK_CONNECTION"):
        _listing(fs)  # every attempt of the client dropped
    assert proxy.injected == {"outage": SDK_ATTEMPTS}
    _listing(fs)  # the next call: its first attempt is the last drop, its second goes through
    assert proxy.injected == {"outage": SDK_ATTEMPTS + 1}


def test_without_drops_a_short_outage_lets_the_clients_retry_through(s3_server, proxy):
    fs = s3_server.filesystem(endpoint_override=proxy.endpoint)
    proxy.outage(0.01, methods=READS, pattern=LISTING)
    _listing(fs)  # a later attempt of the client comes after the outage ended
    assert 0 < proxy.injected["outage"] < SDK_ATTEMPTS
