"""The README quick start, end to end: ``ray-fsdp train examples/cpu_tiny.yaml``.

Runs the command as a user would (a fresh process, no ``RAY_ADDRESS``, so it
starts its own local Ray cluster with two CPU workers under FSDP2), shortened
with ``--set``, and checks that the loss goes down and the outputs exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_trains_and_lowers_the_loss(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/cpu_tiny.yaml",
            "--set", "train.steps=40", "--set", "train.log_every=10",
            "--set", f"run.storage_path={tmp_path}", "--set", "run.name=quick",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]

    # Progress lines: step, loss, tokens/s and ETA.
    assert re.search(r"step 10/40 \| loss \d+\.\d+ .* tok/s \| ETA \d\d:\d\d:\d\d", log), log[
        -3000:
    ]
    first, last = map(float, re.search(r"loss (\S+) \(step 1\) -> (\S+) \(step 40\)", log).groups())
    assert first > 5.0 and last < first - 1.5

    run_dir = tmp_path / "quick"
    assert f"results:    {run_dir}" in out.stdout
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in history] == [1, 10, 20, 30, 40]
    assert all(m["tokens_per_s"] > 0 for m in history)
    png = (run_dir / "loss_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG")
