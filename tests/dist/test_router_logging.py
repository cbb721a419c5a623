"""Router statistics in the trainer's logs: ``run_training`` (what
``ray-fsdp train`` runs) on a tiny Qwen3-MoE with ``output_router_logits``
logs each layer's expert load and the auxiliary load-balancing loss on
logged steps only, with no host sync on the other steps (2 gloo ranks,
FSDP2), and at ep 2 the same values as one process on the same global batch
(the load over the global batch; the aux loss averaged over the ranks'
micro-batches, as the one process averages it over its micro-batches).

One 2-rank spawn runs both 2-rank cases; a 1-rank spawn the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.test_step_syncs import CPU_KERNEL_READS, _inside

MOE_EP = Path(__file__).resolve().parents[2] / "examples" / "moe_ep.yaml"
STEPS, LOG_EVERY = 4, 3
LOGGED = [1, 3, 4]
# The CPU kernel of grouped_mm (transformers' experts) reads each group's
# offset with item(), 48 per step here with or without the router hooks; the
# CUDA kernel reads them on the device. Not counted, like fused AdamW's.
KERNEL_READS = (*CPU_KERNEL_READS, "aten::_grouped_mm")
ROUTER_KEYS = {f"router/layer{i}/max_over_mean" for i in (0, 1)}


def _train(path: str, overrides: list[str], world: int) -> dict:
    from ray_fsdp_backend.runtime.worker import setup_process_context
    from ray_fsdp_backend.trainer.loop.train import fit_global_batch, run_training
    from ray_fsdp_backend.trainer.schema.spec import load_spec

    spec = load_spec(
        MOE_EP,
        [
            f"model.pretrained={path}", "model.export=null", "model.seq_len=32",
            f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}",
            "train.global_batch_size=4", "train.micro_batch_size=2", *overrides,
        ],
    )  # fmt: skip
    ctx = setup_process_context(spec.distributed, torch.device("cpu"))
    spec = fit_global_batch(spec, ctx.dp_size, ctx.world_rank)
    windows: dict[int, torch.profiler.record_function] = {}

    def on_step(step: int) -> None:
        windows[step].__exit__(None, None, None)
        windows[step + 1] = torch.profiler.record_function(f"step_{step + 1}")
        windows[step + 1].__enter__()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        windows[1] = torch.profiler.record_function("step_1")
        windows[1].__enter__()
        history = run_training(ctx, spec, report=lambda m: None, on_step=on_step, resume=False)
        windows[STEPS + 1].__exit__(None, None, None)
    spans = {int(e.name[5:]): e.time_range for e in prof.events() if e.name.startswith("step_")}
    syncs = dict.fromkeys(spans, 0)
    for e in prof.events():
        if e.name == "aten::_local_scalar_dense" and not _inside(e, KERNEL_READS):
            step = next((s for s, w in spans.items() if w.start <= e.time_range.start <= w.end))
            syncs[step] += 1
    return {"history": history, "syncs": syncs}


def _ranks(rank: int, world: int, path: str) -> dict:
    return {
        "fsdp": _train(path, ["distributed.expert_parallel_size=1"], world),
        "ep2": _train(path, ["distributed.expert_parallel_size=2"], world),
    }


def _single(rank: int, world: int, path: str) -> dict:
    return _train(path, ["distributed.expert_parallel_size=1"], world)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    path = save_tiny_pretrained("qwen3_moe", tmp_path_factory.mktemp("moe") / "ckpt")
    config = Path(path) / "config.json"
    values = json.loads(config.read_text())
    config.write_text(json.dumps(values | {"output_router_logits": True}))
    return path


def test_router_metrics_on_logged_steps_only_and_equal_to_one_process(checkpoint):
    got = run_ranks(_ranks, 2, checkpoint)
    reference = run_ranks(_single, 1, checkpoint)["history"]
    for name, case in got.items():
        history = case["history"]
        assert [m["step"] for m in history] == LOGGED, name
        for metrics in history:
            assert ROUTER_KEYS <= metrics.keys() and "aux_loss" in metrics, name
            assert all(1.0 <= metrics[k] <= 4.0 for k in ROUTER_KEYS), metrics
            assert metrics["aux_loss"] > 0.0
    # FSDP2 steps that do not log read nothing to the host (EP's all-to-all
    # reads its split sizes each layer: transformers' AllToAllEP) but the one
    # bool per forward transformers reads to build packed rows' per-document
    # mask (find_packed_sequence_indices: `(mask[:, -1] == 0).all()`), which
    # it reads only without a cache, so since ctx.wrap turns the cache off at
    # cp 1 too (packed rows attended across documents before).
    assert got["fsdp"]["syncs"][2] <= 1, got["fsdp"]["syncs"]
    for name, case in got.items():
        for key in (*sorted(ROUTER_KEYS), "aux_loss", "loss"):
            values = [m[key] for m in case["history"]]
            expected = [m[key] for m in reference]
            torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
