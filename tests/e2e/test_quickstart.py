"""The README quick start, end to end: ``ray-fsdp train examples/cpu_tiny.yaml``.

Runs the command as a user would (a fresh process, no ``RAY_ADDRESS``, so it
starts its own local Ray cluster with two CPU workers under FSDP2), shortened
with ``--set``, and checks that the loss goes down and the outputs exist. The
same run (one Ray start) checks what a user watches: the progress lines and
no Ray report lines on the console, the reported step metrics (tokens counted,
throughput, memory, MFU with a configured peak) and the TensorBoard scalars.

Another local cluster runs on the host throughout (this pytest worker's shared
one, ``ray_local``), as on a crowded machine: Ray Train's placement-group
cleaner, which would search the host for its cluster and print "Found multiple
active Ray instances", must find the run's own (``ray_fsdp_backend.runtime.ray_start``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.console import assert_console_is_sample, assert_quiet

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_trains_and_lowers_the_loss(tmp_path, ray_local):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/cpu_tiny.yaml",
            "--set", "train.steps=40", "--set", "train.log_every=10",
            "--set", f"run.storage_path={tmp_path}", "--set", "run.name=quick",
            "--set", f"logging.tensorboard={tmp_path / 'tb'}",
            "--set", "distributed.peak_tflops=0.5",
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300,
    )  # fmt: skip
    log = out.stdout  # stdout and stderr as a terminal interleaves them
    assert out.returncode == 0, log[-4000:]
    assert_console_is_the_readmes(log)

    # Progress lines: step, loss, tokens/s, MFU, memory and ETA; no Ray report lines.
    progress = r"step 10/40 \| loss \d+\.\d+ .* tok/s .* \| MFU \d+\.\d% .* GiB \| ETA \d\d:"
    assert re.search(progress, log), log[-3000:]
    assert "Reporting training result" not in log
    first, last = map(float, re.search(r"loss (\S+) \(step 1\) -> (\S+) \(step 40\)", log).groups())
    assert first > 5.0 and last < first - 1.5
    assert_quiet(log)

    run_dir = tmp_path / "quick"
    assert f"results:    {run_dir}" in out.stdout
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in history] == [1, 10, 20, 30, 40]
    # The README's sample is this run's (steps 1 and 10 come before the schedule's
    # decay, so 40 steps print them as 150 do), to 4 digits.
    from benchmarks.samples import sample_losses

    run_losses = tuple(f"{m['loss']:.4f}" for m in history[:2])
    assert sample_losses((REPO / "README.md").read_text()) == run_losses, (
        "README.md's quick-start sample is from another run: regenerate the docs' samples "
        "with `python -m benchmarks.samples` and commit them"
    )
    # No spike: the quick start's loss fell at every logged step (it once
    # jumped 3.35 -> 6.22 at step 20: a peak rate too high for the plateau).
    losses = [m["loss"] for m in history]
    assert all(b < a + 0.05 for a, b in zip(losses, losses[1:], strict=False)), losses
    tokens_per_step = 2 * 8 * 128  # workers x micro_batch_size x seq_len (grad_accum 1)
    for m in history:
        assert m["tokens_seen"] == m["step"] * tokens_per_step
        assert m["tokens_per_s"] > 0 and m["step_time_s"] > 0 and m["eta_s"] >= 0
        assert m["tokens_per_s_per_rank"] == pytest.approx(m["tokens_per_s"] / 2)
        assert m["memory_peak_allocated_gib"] > 0.05 and m["memory_peak_reserved_gib"] > 0.05
        # MFU = achieved FLOP/s per rank over the configured 0.5 TFLOP/s peak.
        assert 0 < m["mfu_pct"] == pytest.approx(m["tflops_per_rank"] / 0.5 * 100)
        # FLOPs per token read off the sharded model: the hand count in test_metrics.py.
        flops = 6_101_760 * m["tokens_per_s_per_rank"] / 1e12
        assert m["tflops_per_rank"] == pytest.approx(flops)
        assert m["data_position"] == m["step"] * 2 * 8  # global samples read
    assert_tensorboard_has(tmp_path / "tb", history)
    png = (run_dir / "loss_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def assert_console_is_the_readmes(log: str) -> None:
    """The run's whole console is README.md's quick start sample, line for line."""
    assert_console_is_sample(log, REPO / "README.md", "quickstart")


def assert_tensorboard_has(log_dir: Path, history: list[dict]) -> None:
    """The event files hold the run's loss series (read by tensorboard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert list(log_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(log_dir)).Reload()
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(m["step"], pytest.approx(m["loss"])) for m in history]
    assert {"tokens_per_s", "mfu_pct", "memory_peak_reserved_gib"} <= set(events.Tags()["scalars"])
