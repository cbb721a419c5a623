"""``examples/pipeline_tiny.yaml`` end to end: ``ray-fsdp train`` at pipeline
parallelism 2 x data parallelism 2 on 4 CPU workers (joining the pytest
worker's shared Ray cluster, ``RAY_ADDRESS``), on a tiny transformers Llama.

The run's logged losses and gradient norms equal the trainer's own loop at
pp 1 in this process (one gloo rank, the same global rows: micro-batch 4
against 2 per dp rank), and its export, written by both stages, loads with
transformers alone and gives that reference model's logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ray_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pipeline_tiny.yaml"
STEPS = 4


def _pp1_reference(overrides: list[str]):
    """The trainer's loop (``run_training``) at pp 1 on one gloo rank; its
    history and trained model."""
    import torch.distributed as dist

    from ray_fsdp_backend.runtime.worker import setup_process_context
    from ray_fsdp_backend.settings.config import FSDPSettings
    from ray_fsdp_backend.trainer.loop.train import setup_run, train_step
    from ray_fsdp_backend.trainer.schema.spec import load_spec
    from tests.dist.harness import free_port

    spec = load_spec(EXAMPLE, [*overrides, "model.export=null", "train.micro_batch_size=4"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        settings = FSDPSettings(use_fsdp=True, use_mixed_precision=False)
        ctx = setup_process_context(settings, torch.device("cpu"))
        run = setup_run(ctx, spec, resume=False)
        history = []
        for step in range(1, STEPS + 1):
            ctx.seed_step(spec.train.seed, step)
            result = train_step(ctx, run.model, run.optimizer, run.batches, spec)
            run.schedule.step()
            history.append({"loss": float(result.loss), "grad_norm": float(result.grad_norm)})
        state = {k: _whole(v) for k, v in run.model.state_dict().items()}
    finally:
        dist.destroy_process_group()
    return history, state


def _whole(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (value.full_tensor() if isinstance(value, DTensor) else value).detach()


def test_pipeline_example_matches_pp1_and_exports(tmp_path, ray_address):
    from transformers import AutoModelForCausalLM

    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    pretrained = save_tiny_pretrained("llama", tmp_path / "pretrained")
    export = tmp_path / "export"
    sets = [f"model.pretrained={pretrained}", f"train.steps={STEPS}", "train.log_every=1"]
    env = ray_env(ray_address)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    run_sets = [*sets, f"model.export={export}", f"run.storage_path={tmp_path}", "run.name=pp"]
    out = subprocess.run(
        [sys.executable, "-m", "ray_fsdp_backend.cli", "train", str(EXAMPLE),
         *[arg for s in run_sets for arg in ("--set", s)]],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    lines = (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()
    got = [json.loads(line) for line in lines]
    reference, state = _pp1_reference(sets)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    trained = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    trained.load_state_dict(state)
    ids = torch.arange(64).reshape(2, 32) % trained.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=0, atol=1e-4)
