"""DPO end to end (docs/preference.md): ``ray-fsdp train examples/dpo.yaml``
with the pairs as parquet on a real S3 API (moto server on loopback), LoRA
on a tiny Llama whose tokenizer has a chat template, the reference its
adapters off, 2 CPU workers, one Ray session (the command's).

The pairs are ``make_pairs``' (64 to train on, as the example's header
writes them; 16 others, another seed, held out through ``data.eval_path``).
The logged ``rewards/accuracies`` reaches 0.9 by the last step, the held-out
``eval/rewards/*`` are logged at the example's eval steps, and the merged
export, loaded by ``transformers`` alone in a fresh process, prefers the
chosen answers: over every training pair its log-prob margin (chosen minus
rejected, the responses' tokens after the chat template's prompt) is
positive on average, above the base's, and its implicit reward (the margin
over the base's) ranks the chosen first for at least 90% of the pairs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BUCKET = "e2e-dpo"

# Each pair's log-prob margin under each model (one process for both: one
# torch and transformers import): transformers only.
_MARGINS = """
import json, sys
sys.modules.setdefault("torchao", None)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pairs = json.loads(sys.argv[1])

def response_log_prob(prompt, response):
    start = len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
    ids = tokenizer.apply_chat_template(prompt + response, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    log_probs = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    return float(log_probs[start - 1:].sum())

for path in sys.argv[2:]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    margins = []
    for pair in pairs:
        chosen = response_log_prob(pair["prompt"], pair["chosen"])
        rejected = response_log_prob(pair["prompt"], pair["rejected"])
        margins.append(chosen - rejected)
    print(json.dumps(margins))
"""


def _upload(s3_server, files: dict[str, str]) -> dict[str, str]:
    fs = s3_server.filesystem()
    fs.create_dir(BUCKET)
    uris = {}
    for name, local in files.items():
        key = f"{BUCKET}/pairs/{os.path.basename(local)}"
        with open(local, "rb") as src, fs.open_output_stream(key) as dst:
            dst.write(src.read())
        uris[name] = f"s3://{key}"
    return uris


def _s3_env(s3_server) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env |= {
        "AWS_ENDPOINT_URL": f"http://{s3_server.endpoint}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    return env


def _margins(paths, pairs) -> list[list[float]]:
    """Per model path, every pair's margin (chosen minus rejected)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    out = subprocess.run(  # without PYTHONPATH: transformers only, no code of ours
        [sys.executable, "-c", _MARGINS, json.dumps(pairs), *map(str, paths)],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_dpo_yaml_from_s3_parquet_to_a_model_that_prefers_the_chosen(s3_server, tmp_path):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained
    from ray_fsdp_backend.preference.make_pairs import make_pairs, write_pairs

    pretrained = save_tiny_pretrained("llama", tmp_path / "pretrained", chat=True)
    train = make_pairs(64)  # the example header's command
    files = {
        "train": write_pairs(str(tmp_path / "pairs" / "train.parquet"), train),
        "eval": write_pairs(str(tmp_path / "pairs" / "eval.parquet"), make_pairs(16, seed=1)),
    }
    data = _upload(s3_server, files)
    export = tmp_path / "export"
    out = subprocess.run(
        [
            sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/dpo.yaml",
            "--set", f"model.pretrained={pretrained}", "--set", f"model.export={export}",
            "--set", f"data.path={data['train']}", "--set", f"data.eval_path={data['eval']}",
            "--set", "data.eval_fraction=null",
            "--set", f"run.storage_path={tmp_path}", "--set", "run.name=dpo",
        ],
        cwd=REPO, env=_s3_env(s3_server), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    with open(tmp_path / "dpo" / "metrics.jsonl") as f:
        history = [json.loads(line) for line in f]
    last = history[-1]
    assert last["step"] == 60 and last["rewards/accuracies"] >= 0.9, last
    assert last["rewards/margins"] > 0 and last["loss"] < math.log(2), last
    evals = [m for m in history if "eval/rewards/accuracies" in m]
    assert [m["step"] for m in evals] == [30, 60], evals  # eval_every: 30
    assert all(math.isfinite(m["eval_loss"]) and "eval/rewards/margins" in m for m in evals)
    assert "margin" in log and "acc" in log  # the progress line's rewards

    trained, base = _margins([export, pretrained], train)
    mean = sum(trained) / len(trained)
    rewards_right = sum(t - b > 0 for t, b in zip(trained, base, strict=True)) / len(train)
    print(f"margin {sum(base) / len(base):.3f} -> {mean:.3f}, reward accuracy {rewards_right}")
    assert mean > 0 and mean > sum(base) / len(base), (mean, base)
    assert rewards_right >= 0.9, rewards_right
