"""``ctx.stream_weights`` on 2 gloo ranks: the buckets hold exactly the
tensors ``export_model`` writes (names, order of keys aside, and bytes), under
FSDP2, tp 2, ep 2 (a Qwen3-MoE, experts split per expert) and LoRA (adapters
merged), each bucket within its bound; a pipeline stage is refused by name."""

from __future__ import annotations

import os

import pytest
import torch

from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
from ray_fsdp_backend.distributed.mesh import build_device_mesh, resolve_layout
from ray_fsdp_backend.hf import export_model
from ray_fsdp_backend.hf.models import build_causal_lm
from ray_fsdp_backend.hf.stream import stream_weights
from ray_fsdp_backend.planning.topology import topology_from_node_counts
from tests.dist.harness import run_ranks
from tests.hf_models import fine_tune, read_safetensors, save_tiny_pretrained

pytest.importorskip("transformers")
pytest.importorskip("peft")

BUCKET = 6 * 1024  # bytes: several buckets of the tiny models' tensors
LAYOUTS = {
    "fsdp": ("llama", {}),
    "tp2": ("llama", {"tensor_parallel_size": 2}),
    "ep2": ("qwen3_moe", {"expert_parallel_size": 2}),
    "lora": ("llama", {}),
}


def _model(rank: int, name: str, path: str):
    kind, options = LAYOUTS[name]
    config = FSDPConfig(use_fsdp=True, use_mixed_precision=False, **options)
    layout = resolve_layout(config, topology_from_node_counts([2]))
    mesh = build_device_mesh(layout, "cpu")
    strategy = build_strategy(config, device=torch.device("cpu"), local_rank=rank, mesh=mesh)
    model = build_causal_lm(path)
    if name == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model = strategy.wrap(model)
    load_pretrained(model, path)
    fine_tune(model, rank, 2)  # trained: lora_B is no longer zero
    return model


def _ranks(rank: int, world: int, root: str) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out = {}
    for name, (kind, _) in LAYOUTS.items():
        path = os.path.join(root, kind)
        model = _model(rank, name, path)
        export = export_model(model, os.path.join(root, f"export_{name}"))
        buckets = [[(key, t.clone()) for key, t in bucket] for bucket in stream_weights(
            model, bucket_bytes=BUCKET
        )]  # fmt: skip
        out[name] = {"export": export, "buckets": buckets}
    model.pipeline_plan = object()  # what a pipeline stage carries
    with pytest.raises(ValueError, match="a pipeline stage holds only its own layers"):
        next(stream_weights(model))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stream")
    for kind in ("llama", "qwen3_moe"):
        save_tiny_pretrained(kind, root / kind)
    return run_ranks(_ranks, 2, str(root), timeout_s=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_streamed_tensors_equal_the_export_bit_for_bit(runs, layout):
    run = runs[layout]
    exported = read_safetensors(run["export"])
    streamed = [pair for bucket in run["buckets"] for pair in bucket]
    names = [name for name, _ in streamed]
    assert len(names) == len(set(names))
    assert set(names) == set(exported)
    for name, tensor in streamed:
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name
    if layout == "ep2":  # per-expert keys, as save_pretrained writes them
        assert any(".experts.3." in name for name in names)
    if layout == "lora":  # merged under the base's names
        assert not any("lora_" in name or "base_layer" in name for name in names)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_bucket_is_within_its_bound(runs, layout):
    buckets = runs[layout]["buckets"]
    assert len(buckets) > 2
    for bucket in buckets:
        size = sum(t.nbytes for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1, [(n, t.nbytes) for n, t in bucket]
