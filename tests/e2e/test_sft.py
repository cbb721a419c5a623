"""Supervised fine-tuning end to end (docs/sft.md): ``ray-fsdp train
examples/sft_chat.yaml`` (at 50 steps) with the chat records as parquet on a real S3 API
(moto server on loopback), LoRA on a tiny Llama whose tokenizer has a chat
template, 2 CPU workers, one Ray session (the command's). The loss falls,
the held-out loss is logged, and the merged export, loaded by
``transformers`` alone in a fresh process and asked a training question
through the chat template, answers it greedily with the trained answer. The
same run's console is docs/sft.md's sample, line for line (numbers and paths
aside), with no warning line docs/monitoring.md does not list."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.console import assert_console_is_sample, assert_quiet

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BUCKET = "e2e-sft"
STEPS = 50
"""Half the example's 100 (issue 45: the suite's time); its schedule ends at
50 and the answers are learnt by then (measured: loss 5.02 -> 1.02, all 4
answers right; at 100 steps 5.02 -> 0.79). Fewer do not answer reliably
(issue 45, train.seed 0/1/2: 20 steps 0, 0, 0 of 4 right; 30 steps 2 of 4;
40 steps 3, 3, 2 of 4), so 50 is the floor with margin."""

# The snippet of docs/sft.md, "Ask the model", for every training conversation
# (its messages up to the answer: system prompt included where it had one).
_ASK = """
import json, sys
sys.modules.setdefault("torchao", None)  # as the snippet: no quantising, no torchao lines
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path).eval()
for messages in json.loads(sys.argv[2]):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    answer = out[0, ids["input_ids"].shape[1]:]
    print(json.dumps(tokenizer.decode(answer, skip_special_tokens=True)))
"""


def _upload(s3_server, files: dict[str, str]) -> dict[str, str]:
    """The local files on the S3 server; returns their ``s3://`` URIs."""
    fs = s3_server.filesystem()
    fs.create_dir(BUCKET)
    uris = {}
    for name, local in files.items():
        key = f"{BUCKET}/chat/{os.path.basename(local)}"
        with open(local, "rb") as src, fs.open_output_stream(key) as dst:
            dst.write(src.read())
        uris[name] = f"s3://{key}"
    return uris


def _s3_env(s3_server) -> dict[str, str]:
    """The environment a user sets for an S3-compatible store: pyarrow (the
    driver's check, Ray Data's readers) reads the endpoint and keys from it."""
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


def test_sft_chat_yaml_from_s3_parquet_to_a_model_that_answers(s3_server, tmp_path):
    from ray_fsdp_backend.models.tiny_pretrained import (
        CHAT_TRAIN,
        chat_records,
        save_tiny_chat_data,
        save_tiny_pretrained,
    )

    pretrained = save_tiny_pretrained("llama", tmp_path / "pretrained", chat=True)
    data = _upload(s3_server, save_tiny_chat_data(tmp_path / "chat", parquet=True))
    export = tmp_path / "export"
    out = subprocess.run(
        [
            sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/sft_chat.yaml",
            "--set", f"model.pretrained={pretrained}", "--set", f"model.export={export}",
            "--set", f"data.path={data['train']}", "--set", f"data.eval_path={data['eval']}",
            "--set", f"run.storage_path={tmp_path}", "--set", "run.name=sft",
            "--set", f"train.steps={STEPS}",
        ],
        cwd=REPO, env=_s3_env(s3_server), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=600,
    )  # fmt: skip
    log = out.stdout  # stdout and stderr as a terminal interleaves them
    assert out.returncode == 0, log[-4000:]
    # What a user watches: docs/sft.md's console (no Ray Data progress, deprecation
    # or execution lines), as quiet as the quick start's.
    assert_console_is_sample(log, REPO / "docs" / "sft.md", "sft_chat")
    assert_quiet(log)
    summary = re.search(rf"loss (\S+) \(step 1\) -> (\S+) \(step {STEPS}\)", log)
    first, last = map(float, summary.groups())
    assert last < 0.5 * first, (first, last)
    assert "eval loss" in log, log[-3000:]
    with open(tmp_path / "sft" / "metrics.jsonl") as f:
        history = [json.loads(line) for line in f]
    evals = {m["step"]: m["eval_loss"] for m in history if "eval_loss" in m}
    assert sorted(evals) == [25, 50], evals  # eval_every: 25
    assert all(math.isfinite(v) for v in evals.values()), evals

    questions = [r["messages"][:-1] for r in chat_records(CHAT_TRAIN)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    asked = subprocess.run(  # without PYTHONPATH: transformers only, no code of ours
        [sys.executable, "-c", _ASK, str(export), json.dumps(questions)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr[-3000:]
    answers = [json.loads(line) for line in asked.stdout.splitlines()]
    # A random 2-layer base and 50 steps: most answers word for word, not always all.
    right = sum(got == want for got, (_, want) in zip(answers, CHAT_TRAIN, strict=True))
    print(f"loss {first} -> {last}; {right} of {len(answers)} answers right: {answers}")
    assert right >= 3, answers
