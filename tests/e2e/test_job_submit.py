"""Job submission round trip: a token-authenticated head on loopback, then
``examples/submit_job.sh`` runs a short ``ray-fsdp train`` as a Ray job.

The head is this test's own: its own temp dir, free ports for every service,
its own token, and it is stopped by killing its process group and any process
whose command line names its temp dir (``ray stop`` would stop every Ray
cluster on the machine, including other tests').
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
    "--ray-client-server-port",
    "--node-manager-port",
    "--object-manager-port",
)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def auth_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def pids_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (this head's temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def stop_head(proc: subprocess.Popen, temp_dir: str) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for pid in pids_naming(temp_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline and (proc.poll() is None or pids_naming(temp_dir)):
            time.sleep(0.5)
        if proc.poll() is not None and not pids_naming(temp_dir):
            return


def wait_for_dashboard(url: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                return
        except OSError as exc:  # not up yet; 401 (auth) also means it is up
            if getattr(exc, "code", None) == 401:
                return
            time.sleep(1)
    raise TimeoutError(f"dashboard at {url} did not come up in {timeout_s} s")


@pytest.fixture
def ray_head():
    """A token-authenticated single-node head on 127.0.0.1; yields (url, env)."""
    from ray._private.authentication.authentication_token_generator import (
        generate_new_authentication_token,
    )

    # Short path: Ray's unix sockets live under it (108-byte limit).
    temp_dir = tempfile.mkdtemp(prefix="rfbjob", dir="/tmp")
    env = auth_env(generate_new_authentication_token())
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    cmd = [
        "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1", "--num-cpus=4", "--num-gpus=0",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
        *(f"{flag}={port}" for flag, port in ports.items()),
    ]  # fmt: skip
    log = open(os.path.join(temp_dir, "ray_start.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{ports['--dashboard-port']}"
    try:
        wait_for_dashboard(url, proc)
        yield url, env
    finally:
        stop_head(proc, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_training_runs_as_a_ray_job(ray_head, tmp_path):
    url, env = ray_head
    env = {**env, "RAY_ADDRESS": url}
    out = subprocess.run(
        [
            str(REPO / "examples" / "submit_job.sh"), "examples/cpu_tiny.yaml",
            "--set", "train.steps=10", "--set", "train.log_every=5",
            "--set", f"run.storage_path={tmp_path}", "--set", "run.name=job",
        ],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    job_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", log).group(1)
    assert f"Job '{job_id}' succeeded" in log, log[-4000:]
    assert re.search(r"loss 5\.\d+ \(step 1\) -> \d\.\d+ \(step 10\)", log), log[-4000:]
    assert (tmp_path / "job" / "loss_curve.png").stat().st_size > 0

    status = subprocess.run(
        ["ray", "job", "status", "--address", url, job_id],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert re.search(r"succeeded", status.stdout + status.stderr, re.IGNORECASE)

    # Token authentication is on: a client without the token is refused.
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    no_token["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "no-such-token")
    refused = subprocess.run(
        ["ray", "job", "list", "--address", url],
        env=no_token, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode != 0
