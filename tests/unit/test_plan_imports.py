"""``ray-fsdp plan`` and ``validate`` start in well under 2 s: they import
neither torch (about 4 s here), ``transformers`` nor Ray (about 2.5 s) where
the answer needs none of them (docs/parallelism.md, "Planning a layout").

Each command runs in a fresh interpreter that reports what it imported, so
a module-level ``import torch`` (or ``import ray``) added anywhere on these
paths fails here, without any timing. Covered: the example decoder (DMuon's
owners included, chosen from its shapes), ``--hf-config`` shapes, and a
local pretrained checkpoint with LoRA (counted from its safetensors headers)
or cut into pipeline stages (the split's rules read from its ``config.json``).
Left out, still importing torch (never Ray): a pretrained checkpoint's
layout rules under tp or ep, and its DMuon plan (a meta model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import contextlib, io, json, sys
from ray_fsdp_backend.cli.main import main
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    heavy = [m for m in ("torch", "ray", "transformers") if m in sys.modules]
    print(json.dumps({"args": args, "code": code, "imported": heavy, "output": out.getvalue()}))
"""

_LLAMA_70B_TP8 = [
    "--nodes", "4", "--gpus-per-node", "8", "--hf-config", "examples/llama3_70b.config.json",
    "--set", "distributed.tensor_parallel_size=8",
]  # fmt: skip
_QWEN3_MOE_EP8 = [
    "--nodes", "2", "--gpus-per-node", "8", "--hf-config", "examples/qwen3_30b_a3b.config.json",
    "--set", "distributed.expert_parallel_size=8",
]  # fmt: skip
_TORCH_FREE_EXAMPLES = [
    "cpu_tiny", "ddp", "elastic_spot", "fsdp_1node_8gpu", "hsdp_multinode", "long_context"
]  # fmt: skip
COMMANDS = [
    *(
        ["plan", f"examples/{name}.yaml", "--nodes", "2", "--gpus-per-node", "4"]
        for name in _TORCH_FREE_EXAMPLES
    ),
    ["plan", "examples/fsdp_1node_8gpu.yaml", *_LLAMA_70B_TP8],
    ["plan", "examples/fsdp_1node_8gpu.yaml", *_QWEN3_MOE_EP8],
    [
        "validate",
        *(f"examples/{name}.yaml" for name in _TORCH_FREE_EXAMPLES),
        "examples/dmuon.yaml",
    ],
    ["plan", "examples/dmuon.yaml", "--nodes", "1", "--gpus-per-node", "8"],
    # docs/parallelism.md's pipeline plan: the split's rules for the decoder, no meta model
    ["plan", "examples/fsdp_1node_8gpu.yaml", "--nodes", "4", "--gpus-per-node", "8",
     "--hf-config", "examples/llama3_70b.config.json", "--set", "model.tie_embeddings=false",
     "--set", "distributed.pipeline_parallel_size=4",
     "--set", "distributed.pipeline_microbatches=8"],
]  # fmt: skip
"""Commands whose answer needs neither torch nor Ray: every example without a
pretrained checkpoint, the 70B and Qwen3-MoE ``--hf-config`` shapes, and the
70B cut into 4 pipeline stages."""


def run_cli(commands: list[list[str]]) -> list[dict]:
    """``ray-fsdp`` with each of ``commands`` in turn, in one fresh
    interpreter: after each, its exit code, output and the heavy modules
    imported so far."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(commands)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    """``examples/finetune_lora.yaml`` and ``examples/pipeline_tiny.yaml`` on a
    tiny Llama checkpoint written here (several safetensors files and an
    index, as ``save_pretrained`` writes)."""
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    root = tmp_path_factory.mktemp("plan-imports")
    checkpoint = save_tiny_pretrained("llama", root / "llama")
    paths = {}
    for name in ("finetune_lora", "pipeline_tiny"):
        doc = yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())
        doc["model"]["pretrained"] = checkpoint
        doc["model"]["export"] = str(root / f"{name}-export")
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(doc))
    return {name: str(path) for name, path in paths.items()}


def test_plan_and_validate_import_neither_torch_nor_ray(configs):
    """And the check can fail: a pretrained plan under expert_parallel_size 2,
    run last, imports torch and ``transformers`` (the expert rule runs on a
    meta model, which refuses this dense Llama), never Ray. The NF4 rule reads
    the headers (it refuses this tiny Llama's shards too: exit code 2)."""
    lora_config, pipeline = configs["finetune_lora"], configs["pipeline_tiny"]
    pretrained = [
        ["plan", pipeline, "--nodes", "1", "--gpus-per-node", "4"],
        ["validate", pipeline],
        ["plan", lora_config, "--nodes", "1", "--gpus-per-node", "2"],
        ["plan", lora_config, "--nodes", "2", "--gpus-per-node", "4"],
        ["validate", lora_config],
        ["plan", lora_config, "--nodes", "1", "--gpus-per-node", "2",
         "--set", "model.lora.base_quantization=nf4"],
    ]  # fmt: skip
    ep = ["plan", lora_config, "--nodes", "1", "--gpus-per-node", "2",
          "--set", "distributed.expert_parallel_size=2"]  # fmt: skip
    *results, last = run_cli([*COMMANDS, *pretrained, ep])
    assert len(results) == len(COMMANDS) + len(pretrained)
    assert results[-1]["code"] == 2  # refused: "base_quantization='nf4' over 2 FSDP shard(s)"
    for result in results[:-1]:  # the first command to import one is named
        assert result["code"] == 0, result
        assert not result["imported"], (" ".join(result["args"]), result["imported"])
        if result["args"][0] == "plan":
            assert "per-GPU memory" in result["output"] or "MoE layers" in result["output"]
    assert not results[-1]["imported"], results[-1]["imported"]
    assert "lora:     frozen base 24,736" in results[-4]["output"], results[-4]["output"]
    assert "DMuon:    Newton–Schulz on 56 matrices" in results[len(COMMANDS) - 2]["output"]
    assert "pipeline: 4 stages" in results[len(COMMANDS) - 1]["output"]
    assert "pipeline: 2 stages" in results[len(COMMANDS)]["output"]  # pipeline_tiny
    assert last["imported"] == ["torch", "transformers"], last["imported"]


def test_train_gets_fsdp_config_plan_the_same_plain_settings():
    """``build_spec`` gives ``TorchTrainer`` Ray's ``TorchConfig`` (``rfb.FSDPConfig``);
    ``plan``'s ``torch_config=False`` the same fields as ``FSDPSettings``."""
    from ray.train.torch import TorchConfig

    from ray_fsdp_backend import FSDPConfig, FSDPSettings
    from ray_fsdp_backend.trainer.schema.spec import build_spec, load_yaml

    doc = load_yaml(REPO / "examples" / "hsdp_multinode.yaml")
    for_train, for_plan = build_spec(doc), build_spec(doc, torch_config=False)
    assert isinstance(for_train.distributed, FSDPConfig)
    assert isinstance(for_train.distributed, TorchConfig)
    assert type(for_plan.distributed) is FSDPSettings
    assert for_plan.distributed.to_dict() == for_train.distributed.to_dict()
    assert for_plan.model == for_train.model and for_plan.train == for_train.train


_IMPORT_ALL = """
import importlib, json, pkgutil, sys
import ray_fsdp_backend
for folder in sys.argv[1:]:
    package = importlib.import_module(f"ray_fsdp_backend.{folder}")
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
print(json.dumps([m for m in ("torch", "ray", "transformers", "pyarrow") if m in sys.modules]))
"""


def test_the_pure_folders_load_without_torch_or_ray():
    """Every module of ``settings/`` and ``planning/`` imported in a fresh
    interpreter loads none of torch, Ray, ``transformers`` or pyarrow (the
    static check of their imports, lazy ones included, is
    ``test_import_graph.test_pure_folders_import_no_torch_ray_or_hugging_face``)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, "settings", "planning"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []
