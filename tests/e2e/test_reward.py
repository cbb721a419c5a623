"""A reward model end to end (docs/preference.md, "Reward models"):
``ray-fsdp train examples/reward.yaml`` on 2 CPU workers, joining the
pytest worker's shared Ray cluster (``ray_address``, no cluster start of its
own): LoRA on a tiny Llama plus its fresh ``score`` head, trained on the
example pairs (``python -m ray_fsdp_backend.preference.make_pairs --task tone``).
``rewards/accuracies`` reaches 1 on the training pairs, the held-out
``eval/rewards/*`` are logged, and the merged export, loaded by
``transformers`` alone in a fresh process as
``AutoModelForSequenceClassification``, scores the chosen answer above the
rejected one on (nearly) every training pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ray_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

# Each pair scored by the export alone, its prompt and answer as one text.
_SCORE = """
import json, sys
sys.modules.setdefault("torchao", None)
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

path = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForSequenceClassification.from_pretrained(path).eval()
print(json.dumps(model.config.architectures))
with torch.no_grad():
    for pair in map(json.loads, open(sys.argv[2])):
        scores = [
            model(**tokenizer(pair["prompt"] + pair[k], return_tensors="pt")).logits[0, 0].item()
            for k in ("chosen", "rejected")
        ]
        print(json.dumps(scores))
"""


def test_reward_yaml_trains_a_classifier_that_ranks_the_chosen_first(tmp_path, ray_address):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained
    from ray_fsdp_backend.preference.make_pairs import make_pairs, write_pairs

    pretrained = save_tiny_pretrained("llama", tmp_path / "pretrained", chat=True)
    pairs = write_pairs(str(tmp_path / "pairs.jsonl"), make_pairs(64, format="text", task="tone"))
    export = tmp_path / "export"
    env = ray_env(ray_address)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/reward.yaml",
            "--set", f"model.pretrained={pretrained}", "--set", f"model.export={export}",
            "--set", f"data.path={pairs}", "--set", f"run.storage_path={tmp_path}",
            "--set", "run.name=reward",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    with open(tmp_path / "reward" / "metrics.jsonl") as f:
        history = [json.loads(line) for line in f]
    first, last = history[0], history[-1]
    assert first["rewards/accuracies"] < 0.9 <= last["rewards/accuracies"], (first, last)
    assert last["rewards/margins"] > 1.0, last
    assert "eval/rewards/accuracies" in last and "eval_loss" in last, last

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    scored = subprocess.run(  # without PYTHONPATH: transformers only, no code of ours
        [sys.executable, "-c", _SCORE, str(export), str(pairs)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-3000:]
    lines = [json.loads(line) for line in scored.stdout.splitlines()]
    assert lines[0] == ["LlamaForSequenceClassification"]
    right = sum(chosen > rejected for chosen, rejected in lines[1:])
    print(f"the export ranks the chosen first on {right} of {len(lines) - 1} training pairs")
    assert right >= 0.9 * (len(lines) - 1), lines
