"""``examples/long_context.yaml`` end to end, and the trainer's context
parallelism against plain data parallelism on the same global batch.

Two runs of the command as a user types it (4 CPU workers each), both
joining the pytest worker's shared Ray cluster (``RAY_ADDRESS``, as inside a
Ray job) rather than starting two clusters:
``dp_shard 2 x cp 2`` with micro-batch 2 (each row split over a cp pair) and
``dp_shard 4 x cp 1`` with micro-batch 1 (a whole row per rank) read the same
4 rows per step, so their losses and gradient norms must agree step by step.
Rows are unpacked here; tests/dist/test_trainer_loop.py runs the trainer's
loop on packed rows (ignored boundary targets) at cp 2 and dp 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ray_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, address: str, name: str, *overrides: str) -> list[dict]:
    env = ray_env(address)  # both runs join the worker's shared cluster
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    sets = ["train.steps=3", "train.log_every=1", "data.packing=false",
            f"run.storage_path={tmp_path}", f"run.name={name}", *overrides]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/long_context.yaml",
         *[arg for s in sets for arg in ("--set", s)]],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_long_context_example_matches_plain_data_parallel(tmp_path, ray_address):
    cp = _train(tmp_path, ray_address, "cp2")
    overrides = ("distributed.context_parallel_size=1", "train.micro_batch_size=1")
    dp = _train(tmp_path, ray_address, "cp1", *overrides)
    assert [m["step"] for m in cp] == [m["step"] for m in dp] == [1, 2, 3]
    for a, b in zip(cp, dp, strict=True):
        assert a["tokens_seen"] == b["tokens_seen"] == a["step"] * 4 * 512
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    assert cp[-1]["loss"] < cp[0]["loss"]
