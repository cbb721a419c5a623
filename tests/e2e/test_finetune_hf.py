"""The README's fine-tuning section end to end: ``ray-fsdp train
examples/finetune_hf.yaml`` on a tiny pretrained Llama made here, then the HF
export loaded by ``transformers`` alone in a fresh process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

_EVAL = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
text = open(sys.argv[3], encoding="utf-8").read()
ids = AutoTokenizer.from_pretrained(sys.argv[1])(text)["input_ids"][: 8 * 64]
ids = torch.tensor(ids).reshape(8, 64)
for path in sys.argv[1:3]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        print(float(model(ids, labels=ids).loss))
"""


def test_finetune_hf_yaml_trains_and_exports(tmp_path):
    from ray_fsdp_backend.trainer.tiny_pretrained import CORPUS, save_tiny_pretrained

    pretrained = save_tiny_pretrained("llama", tmp_path / "pretrained", tied=True)
    export = tmp_path / "finetuned"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/finetune_hf.yaml",
            "--set", f"model.pretrained={pretrained}", "--set", f"model.export={export}",
            "--set", f"run.storage_path={tmp_path}", "--set", "run.name=ft",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    first, last = map(float, re.search(r"loss (\S+) \(step 1\) -> (\S+) \(step 20\)", log).groups())
    assert last < first

    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(
        os.listdir(export)
    )
    plain = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # transformers only
    losses = subprocess.run(
        [sys.executable, "-c", _EVAL, pretrained, str(export), CORPUS],
        cwd=tmp_path, env=plain, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    before, after = map(float, losses)
    assert after < before - 0.05, (before, after)
