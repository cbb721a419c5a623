"""The fine-tuning pages end to end: ``ray-fsdp train examples/finetune_hf.yaml``
and ``examples/finetune_lora.yaml`` on a tiny pretrained Llama made here, then
the HF export loaded by ``transformers`` alone, and the PEFT export by
``peft``, in a fresh process. The fine-tuning run's whole console is
docs/finetuning.md's sample, line for line (``tests/e2e/console.py``).

The LoRA and QLoRA runs use one worker (``--set scaling.num_workers=1``,
:data:`ONE_WORKER`; issue 45, the suite's time): what only Ray adds is the
example through the CLI, its checkpoints and its export; their 2- and
4-rank numbers against one process are tests/dist/test_lora.py's and
tests/dist/test_qlora.py's (FSDP2, HSDP, DDP; NF4 shards cut per rank)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ray_env
from tests.e2e.console import assert_console_is_sample, assert_quiet

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ONE_WORKER = ("scaling.num_workers=1",)

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


def _train_example(
    example: str,
    tmp_path,
    pretrained,
    export,
    name: str,
    address: str | None = None,
    sets: tuple[str, ...] = (),
) -> str:
    """``ray-fsdp train examples/<example>`` on ``pretrained`` (plus a
    ``--set`` for each of ``sets``); returns the log (stdout and stderr as a
    terminal interleaves them). With ``address`` (the ``ray_address``
    fixture) the command joins that cluster, as inside a Ray job; without, it
    starts its own, as a user's does."""
    env = ray_env(address)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable, "-m", "ray_fsdp_backend.cli", "train", f"examples/{example}",
            "--set", f"model.pretrained={pretrained}", "--set", f"model.export={export}",
            "--set", f"run.storage_path={tmp_path}", "--set", f"run.name={name}",
            *[arg for s in sets for arg in ("--set", s)],
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=400,
    )  # fmt: skip
    log = out.stdout
    assert out.returncode == 0, log[-4000:]
    summary = re.search(r"loss (\S+) \(step 1\) -> (\S+) \(step 20\)", log)
    first, last = map(float, summary.groups())
    assert last < first
    return log


def _eval(script: str, *args, cwd) -> list[float]:
    from ray_fsdp_backend.models.tiny_pretrained import CORPUS

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    out = subprocess.run(  # without PYTHONPATH: transformers and peft only, no code of ours
        [sys.executable, "-c", script, *map(str, args), CORPUS],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return [float(x) for x in out.stdout.split()]


def test_finetune_hf_yaml_trains_and_exports(tmp_path, ray_address):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    pretrained = save_tiny_pretrained("llama", tmp_path / "pretrained", tied=True)
    export = tmp_path / "finetuned"
    log = _train_example("finetune_hf.yaml", tmp_path, pretrained, export, "ft", ray_address)
    # What a user watches: docs/finetuning.md's console, this run having joined
    # the shared cluster where the sample's run started its own.
    assert_console_is_sample(log, REPO / "docs" / "finetuning.md", "finetune_hf", joined=True)
    assert_quiet(log, joined=True)
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(
        os.listdir(export)
    )
    before, after = _eval(_EVAL, pretrained, export, cwd=tmp_path)
    assert after < before - 0.05, (before, after)


_EVAL_PEFT = """
import sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
text = open(sys.argv[3], encoding="utf-8").read()
ids = AutoTokenizer.from_pretrained(sys.argv[1])(text)["input_ids"][: 8 * 64]
ids = torch.tensor(ids).reshape(8, 64)
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    print(float(base(ids, labels=ids).loss))
    print(float(PeftModel.from_pretrained(base, sys.argv[2])(ids, labels=ids).loss))
"""


def test_finetune_lora_yaml_checkpoints_adapters_and_exports_peft(tmp_path, ray_address):
    """LoRA adapters on the frozen base: the run's checkpoints hold the
    adapters only, the PEFT export loads with ``peft`` alone."""
    import torch.distributed.checkpoint as dcp

    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    pytest.importorskip("peft")
    pretrained = save_tiny_pretrained("llama", tmp_path / "pretrained")
    export = tmp_path / "adapters"
    log = _train_example(
        "finetune_lora.yaml", tmp_path, pretrained, export, "lora", ray_address, ONE_WORKER
    )
    folders = sorted(p.parent for p in (tmp_path / "lora").rglob(".metadata"))
    assert folders, log[-2000:]
    keys = dcp.FileSystemReader(str(folders[-1])).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights), weights
    with open(export / "adapter_config.json") as f:
        config = json.load(f)
    assert (config["r"], sorted(config["target_modules"])) == (8, ["q_proj", "v_proj"])
    before, after = _eval(_EVAL_PEFT, pretrained, export, cwd=tmp_path)
    assert after < before - 0.02, (before, after)


def test_finetune_qlora_yaml_trains_on_an_nf4_base_and_exports_peft(tmp_path, ray_address):
    """``examples/finetune_qlora.yaml``: adapters over an NF4 base quantised
    shard by shard (one worker here); the PEFT export loads with ``peft`` alone
    over the fp32 base and lowers the loss there too."""
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    pretrained = save_tiny_pretrained("llama_qlora", tmp_path / "pretrained", max_shard_size="2MB")
    export = tmp_path / "adapters"
    _train_example(
        "finetune_qlora.yaml", tmp_path, pretrained, export, "qlora", ray_address, ONE_WORKER
    )
    with open(export / "adapter_config.json") as f:
        config = json.load(f)
    assert config["base_model_name_or_path"] == str(pretrained)
    before, after = _eval(_EVAL_PEFT, pretrained, export, cwd=tmp_path)
    assert after < before - 0.02, (before, after)
