"""``ray-fsdp plan`` and ``validate`` of a chat SFT config (``data.format:
chat``, examples/sft_chat.yaml) import no more than loading the checkpoint's
tokenizer does.

Their checks render the first records of every file with the checkpoint's
chat template, so they load the tokenizer through ``AutoTokenizer``, which
in transformers 5.25 imports torch and ``torch.distributed.tensor`` itself
(its config classes). Nothing else is theirs to import: not Ray, not
torch.distributed.checkpoint (the weights reader), not the worker-side
batches (``trainer.sft_batches``, ``trainer.data``) nor context parallelism.
The driver-side modules themselves import neither torch nor
``transformers``. Each side runs in a fresh interpreter, without timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.unit.test_plan_imports import REPO, run_cli

_MODULES = """
import json, sys
{body}
print(json.dumps(sorted(sys.modules)))
"""
_TOKENIZER = "from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained(sys.argv[1])"
_DRIVER = "import ray_fsdp_backend.trainer.data.sft"
_CLI = """
import contextlib, io
from ray_fsdp_backend.cli.main import main
for args in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0, args
"""
_WORKER_SIDE = (
    "ray_fsdp_backend.distributed.collectives",
    "ray_fsdp_backend.context_parallel",
    "ray_fsdp_backend.hf.reader",
    "ray_fsdp_backend.trainer.data.corpus",
    "ray_fsdp_backend.trainer.data.sft_batches",
)


def modules_after(body: str, *args: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``body``."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _MODULES.format(body=body), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.fixture(scope="module")
def sft_config(tmp_path_factory) -> tuple[str, str]:
    """examples/sft_chat.yaml on a tiny chat Llama and its records written
    here; returns the config and the checkpoint."""
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_chat_data, save_tiny_pretrained

    root = tmp_path_factory.mktemp("plan-imports-sft")
    doc = yaml.safe_load((REPO / "examples" / "sft_chat.yaml").read_text())
    checkpoint = save_tiny_pretrained("llama", root / "chat", chat=True)
    records = save_tiny_chat_data(root / "records")
    doc["model"] |= {"pretrained": checkpoint, "export": str(root / "export")}
    doc["data"] |= {"path": records["train"], "eval_path": records["eval"]}
    path = root / "sft_chat.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path), checkpoint


def test_sft_plan_and_validate_import_only_what_the_tokenizer_does(sft_config):
    config, checkpoint = sft_config
    commands = [
        ["plan", config, "--nodes", "1", "--gpus-per-node", "2"],
        ["validate", config],
        ["plan", config, "--nodes", "2", "--gpus-per-node", "4",
         "--set", "data.packing=false", "--set", "data.train_on_prompt=true"],
    ]  # fmt: skip
    cli = modules_after(_CLI, json.dumps(commands))
    tokenizer = modules_after(_TOKENIZER, checkpoint)
    assert "torch.distributed.checkpoint" not in cli
    assert "ray" not in cli
    extra = sorted(m for m in cli - tokenizer if m.split(".")[0] in ("torch", "transformers"))
    assert not extra, extra[:20]
    assert not [m for m in cli if m.startswith(_WORKER_SIDE)]


def test_sft_driver_modules_import_neither_torch_nor_transformers():
    imported = modules_after(_DRIVER)
    assert not [m for m in ("torch", "transformers", "ray") if m in imported]


def test_sft_plan_says_what_it_said(sft_config):
    """The plan and validate answers are unchanged: the model, the LoRA
    split and ``validate``'s OK (records rendered by the template)."""
    config, _ = sft_config
    plan, validate = run_cli([["plan", config, "--nodes", "1", "--gpus-per-node", "2"],
                              ["validate", config]])  # fmt: skip
    assert plan["code"] == validate["code"] == 0, (plan, validate)
    assert "lora:     frozen base 24,736" in plan["output"], plan["output"]
    assert "ray" not in plan["imported"] and "ray" not in validate["imported"]
