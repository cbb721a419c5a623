"""Online RL end to end (docs/rl.md): ``ray-fsdp train examples/grpo.yaml``
on 2 CPU workers and one transformers rollout engine (a Ray actor), LoRA on
a tiny chat Llama, rewards in Ray tasks. The mean reward rises past its
threshold; the engine, killed at step 3 by the reward function, is
restarted by Ray and the run finishes; a second ``train`` with the same
``run.name`` resumes from the last checkpoint (step, prompt position)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY, MORE = 16, 8, 2
THRESHOLD = 0.25
"""The mean reward (the share of "e" in the responses) the run must pass;
it starts near 0.12 and passed 0.3 by step 10 of the 40-step example (docs/rl.md)."""


def _train(config: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ray_fsdp_backend.cli", "train", str(config)]
    for item in overrides:
        command += ["--set", item]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _history(out: subprocess.CompletedProcess) -> list[dict]:
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("metrics:"))
    path = line.split(":", 1)[1].strip()
    return [json.loads(row) for row in Path(path).read_text().splitlines()]


def test_grpo_yaml_raises_the_reward_survives_a_dead_engine_and_resumes(tmp_path):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained
    from ray_fsdp_backend.rl.example_task import main as write_prompts

    model = save_tiny_pretrained("llama", tmp_path / "model", chat=True)
    write_prompts([str(tmp_path / "prompts.jsonl")])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["RFB_TEST_KILL_MARKER"] = str(tmp_path / "reward_calls")
    common = [
        f"model.pretrained={model}",
        f"data.path={tmp_path / 'prompts.jsonl'}",
        f"run.storage_path={tmp_path / 'runs'}",
        "run.name=grpo-e2e",
        "train.log_every=1",
        f"train.checkpoint_every={CHECKPOINT_EVERY}",
        "reward.function=tests.e2e.rl_fns:letter_share_killing_once",
    ]
    first = _train(REPO / "examples" / "grpo.yaml", env, *common, f"train.steps={STEPS}")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    history = _history(first)
    rewards = [row["reward/mean"] for row in history]
    print("rewards per step:", " ".join(f"{r:.3f}" for r in rewards))
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    assert max(rewards[-3:]) > THRESHOLD > rewards[0]
    assert int((tmp_path / "reward_calls").read_text()) >= STEPS
    assert (tmp_path / "reward_calls.killed").read_text() == "1"  # the engine died at step 3
    assert all(row["sync_bytes"] > 0 and row["sync_s"] > 0 for row in history)
    assert all(0 <= row["clip_fraction"] <= 1 and row["kl"] >= 0 for row in history)

    more = _train(REPO / "examples" / "grpo.yaml", env, *common, f"train.steps={STEPS + MORE}")
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert f"resumed from step {STEPS}" in more.stdout + more.stderr
    extended = _history(more)  # a resumed run extends its run's metrics.jsonl
    assert [row["step"] for row in extended] == list(range(1, STEPS + MORE + 1))
    assert extended[:STEPS] == history
    prompts_per_step = 4  # examples/grpo.yaml
    assert extended[STEPS]["data_position"] == (STEPS + 1) * prompts_per_step
