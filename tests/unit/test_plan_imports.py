"""``ray-fsdp plan`` and ``validate`` start in well under 2 s: they import
neither torch (about 4 s here) nor Ray (about 2.5 s) where the answer needs
neither (docs/parallelism.md, "Planning a layout").

Each command runs in a fresh interpreter that reports what it imported, so
a module-level ``import torch`` (or ``import ray``) added anywhere on these
paths fails here, without any timing. The DMuon plan (owners chosen on a
meta-device model) and pretrained checkpoints (counted on one, read by
``transformers``) do need torch and are left out; they still never import Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import contextlib, io, json, sys
from ray_fsdp_backend.cli import main
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
]
"""Commands whose answer needs neither torch nor Ray: every example without a
pretrained checkpoint (``plan`` of ``dmuon.yaml`` aside) and the 70B and
Qwen3-MoE ``--hf-config`` shapes."""


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


def test_plan_and_validate_import_neither_torch_nor_ray():
    """And the check can fail: the DMuon plan, run last, imports torch (its
    owners are chosen on a meta-device model), never Ray."""
    dmuon = ["plan", "examples/dmuon.yaml", "--nodes", "1", "--gpus-per-node", "8"]
    *results, last = run_cli([*COMMANDS, dmuon])
    assert len(results) == len(COMMANDS)
    for result in results:  # the first command to import one is named
        assert result["code"] == 0, result
        assert not result["imported"], (" ".join(result["args"]), result["imported"])
        if result["args"][0] == "plan":
            assert "per-GPU memory" in result["output"] or "MoE layers" in result["output"]
    assert last["code"] == 0 and last["imported"] == ["torch"], last["imported"]


def test_train_gets_fsdp_config_plan_the_same_plain_settings():
    """``build_spec`` gives ``TorchTrainer`` Ray's ``TorchConfig`` (``rfb.FSDPConfig``);
    ``plan``'s ``torch_config=False`` the same fields as ``FSDPSettings``."""
    from ray.train.torch import TorchConfig

    from ray_fsdp_backend import FSDPConfig, FSDPSettings
    from ray_fsdp_backend.trainer.spec import build_spec, load_yaml

    doc = load_yaml(REPO / "examples" / "hsdp_multinode.yaml")
    for_train, for_plan = build_spec(doc), build_spec(doc, torch_config=False)
    assert isinstance(for_train.distributed, FSDPConfig)
    assert isinstance(for_train.distributed, TorchConfig)
    assert type(for_plan.distributed) is FSDPSettings
    assert for_plan.distributed.to_dict() == for_train.distributed.to_dict()
    assert for_plan.model == for_train.model and for_plan.train == for_train.train
