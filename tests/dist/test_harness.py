"""The gloo harness itself (tests/dist/harness.py): ranks forked from its
forkserver run as spawned ones would, and a failing rank is named.

A rank sees the caller's environment and working directory at the call (not
the forkserver's, started earlier), ``tempfile`` honours the caller's
``TMPDIR``, the forkserver runs a single thread (pyarrow imported here is in
its preload: its jemalloc starts a background thread unless ``SERVER_ENV``
turns it off), and a rank that raises fails the call with its traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pyarrow  # noqa: F401  (the forkserver preloads it: its jemalloc starts a thread)
import pytest
import torch.distributed as dist

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _where(rank, world_size):
    seen = [None] * world_size
    mine = (os.environ.get("HARNESS_PROBE"), tempfile.gettempdir(), os.getcwd())
    dist.all_gather_object(seen, mine)
    return seen


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()


def _server_threads() -> int:
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    return len(os.listdir(f"/proc/{pid}/task"))


def test_ranks_take_the_callers_environment_directory_and_tmpdir(tmp_path, monkeypatch):
    run_ranks(_where, 2)  # the forkserver is running before the caller's changes
    for probe in ("first", "second"):
        cwd, tmp = tmp_path / f"cwd-{probe}", tmp_path / f"tmp-{probe}"
        cwd.mkdir()
        tmp.mkdir()
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("HARNESS_PROBE", probe)
        monkeypatch.setenv("TMPDIR", str(tmp))
        assert run_ranks(_where, 2) == [(probe, str(tmp), str(cwd))] * 2
    assert _server_threads() == 1


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(AssertionError) as failure:
        run_ranks(_raise_on_one, 2, timeout_s=30)
    message = str(failure.value)
    assert "--- rank 1: exit 1" in message and "ValueError: rank one refuses" in message
