"""Tensor parallelism in a real TorchTrainer run: 2 workers, mesh
(dp_shard=1, tp=2), one worker killed right after the step-4 checkpoint; Ray
Train restarts the group, it resumes from step 4 and every step's loss and
pre-clip norm, before and after the kill, equals one process training on the
global batch.

What only Ray adds: the kill, the restart and the resume from Ray's
checkpoint. tp x dp layouts and their reshards are the dist layer's
(``tests/dist/test_tensor_parallel.py``, ``test_tensor_parallel_checkpoint.py``);
4 Ray workers at tp 2 x dp 2, their tp groups on node neighbours, are
``tests/e2e/test_ray_data_mesh.py``'s, so 2 workers here (4 until issue 45)."""

from __future__ import annotations

import json

import pytest
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from safetensors.torch import save_file

import ray_fsdp_backend as rfb
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from tests.e2e.tp_fns import BATCH, LR, MAX_NORM, MODEL, global_batch, train_tp

pytestmark = pytest.mark.e2e

STEPS, EVERY, WORKERS, TP = 6, 2, 2, 2
DP = WORKERS // TP


def _reference(path: str) -> tuple[dict, dict]:
    """Losses and pre-clip norms of one process on the global batch (the mean
    over the ``DP`` parts, as FSDP averages their gradients)."""
    model = Transformer(ModelConfig(**MODEL))
    from safetensors.torch import load_file

    model.load_state_dict(load_file(path), strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = {}, {}
    for step in range(1, STEPS + 1):
        x, y = global_batch(step)
        total = 0.0
        for part in range(DP):
            rows = slice(part * BATCH // DP, (part + 1) * BATCH // DP)
            loss = model.loss(x[rows], y[rows]) / DP
            loss.backward()
            total += loss.item()
        losses[str(step)] = total
        norms[str(step)] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
    return losses, norms


@pytest.fixture(scope="module")
def run(ray_local, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_e2e")
    torch.manual_seed(0)
    init = str(tmp / "init.safetensors")
    state = Transformer(ModelConfig(**MODEL)).state_dict()
    save_file({k: v.clone() for k, v in state.items() if k != "output.weight"}, init)
    fault_dir = tmp / "faults"
    fault_dir.mkdir()
    trainer = TorchTrainer(
        train_tp,
        train_loop_config={
            "steps": STEPS,
            "every": EVERY,
            "fault_dir": str(fault_dir),
            "init": init,
            "kill": [1, 4],
        },  # fmt: skip
        torch_config=rfb.FSDPConfig(
            use_fsdp=True, tensor_parallel_size=TP, use_mixed_precision=False
        ),
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(
            name="tp",
            storage_path=str(tmp / "storage"),
            failure_config=FailureConfig(max_failures=2),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    attempts = sorted(fault_dir.glob("attempt_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return result, [json.loads(p.read_text()) for p in attempts], _reference(init)


def test_tp_run_resumes_after_a_killed_worker_and_matches_one_process(run):
    result, attempts, (ref_losses, ref_norms) = run
    assert len(attempts) >= 2 and attempts[-1]["resumed_from"] == 4
    assert attempts[0]["tp_group"] == [0, 1]
    assert attempts[0]["coords"] == [0, DP, 0, TP]  # dp_rank, dp_size, tp_rank, tp_size
    seen = {}
    for attempt in attempts:
        for step, loss in attempt["losses"].items():
            assert loss == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6), step
            assert attempt["norms"][step] == pytest.approx(ref_norms[step], rel=1e-4), step
            seen[step] = loss
    assert sorted(seen, key=int) == [str(s) for s in range(1, STEPS + 1)]
    assert ref_norms["1"] > MAX_NORM  # the clip is active
    assert result.metrics["step"] == STEPS
