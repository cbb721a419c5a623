"""``ctx.stream_weights`` on gloo ranks: the buckets hold exactly the tensors
``export_model`` writes (names, order of keys aside, and bytes), on every rank,
each bucket within its bound.

2 ranks: FSDP2, tp 2, ep 2 (a Qwen3-MoE, experts split per expert), LoRA
(adapters merged) and pp 2 (a tiny Llama in 2 stages of 1 layer). 4 ranks:
pp 2 x dp_shard 2 (4 layers), the same with 2 virtual stages per rank
(interleaved 1F1B: rank 0 holds layers 0 and 2), a Qwen3-MoE at pp 2 x ep 2,
and pp 2 x dp_shard 2 through ``hf.stream_weights`` without the pipeline
group (every rank broadcasts with every rank). Each pipeline stage holds only
its own layers, and every rank of every stage receives the whole model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
from ray_fsdp_backend.distributed.mesh import build_device_mesh, resolve_layout
from ray_fsdp_backend.hf import export_model
from ray_fsdp_backend.hf.models import build_causal_lm
from ray_fsdp_backend.hf.stream import stream_weights
from ray_fsdp_backend.planning.topology import topology_from_node_counts
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks
from tests.hf_models import fine_tune, read_safetensors, save_tiny_pretrained, tiny_config

pytest.importorskip("transformers")
pytest.importorskip("peft")

BUCKET = 6 * 1024  # bytes: several buckets of the tiny models' tensors
LAYOUTS = {
    "fsdp": ("llama", {}),
    "tp2": ("llama", {"tensor_parallel_size": 2}),
    "ep2": ("qwen3_moe", {"expert_parallel_size": 2}),
    "lora": ("llama", {}),
}
PP = {"pipeline_parallel_size": 2, "pipeline_microbatches": 2}
V2 = {"pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2}
PIPELINES = {  # world -> layout -> (checkpoint, settings)
    2: {"pp2": ("llama", PP)},
    4: {
        "pp2_dp2": ("llama4", PP),
        "pp2v2_dp2": ("llama4", {**PP, **V2}),
        "pp2_ep2": ("qwen3_moe", {**PP, "expert_parallel_size": 2}),
        "pp2_dp2 world": ("llama4", PP),  # hf.stream_weights without pipeline_group
    },
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


def _streamed(stream) -> list:
    """Every rank's buckets (copies), gathered to every rank."""
    mine = [[(key, t.clone()) for key, t in bucket] for bucket in stream]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _pipeline(world: int, root: str, name: str) -> dict:
    kind, options = PIPELINES[world][name]
    path = os.path.join(root, kind)
    ctx = setup_process_context(
        FSDPSettings(use_fsdp=True, use_mixed_precision=False, **options), torch.device("cpu")
    )
    model = ctx.wrap(build_causal_lm(path))
    ctx.load_pretrained(model, path)
    export = ctx.export_model(model, os.path.join(root, f"export_{name}"))
    if name.endswith("world"):
        stream = stream_weights(model, bucket_bytes=BUCKET)
    else:
        stream = ctx.stream_weights(model, bucket_bytes=BUCKET)
    held = sorted(n for n, _ in model.named_parameters())
    return {"export": export, "buckets": _streamed(stream), "held": held}


def _ranks(rank: int, world: int, root: str) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    out = {name: _pipeline(world, root, name) for name in PIPELINES[world]}
    if world == 2:
        for name, (kind, _) in LAYOUTS.items():
            model = _model(rank, name, os.path.join(root, kind))
            export = export_model(model, os.path.join(root, f"export_{name}"))
            out[name] = {
                "export": export,
                "buckets": _streamed(stream_weights(model, bucket_bytes=BUCKET)),
            }
    return out


def _save_llama4(path) -> None:
    """The tiny Llama with 4 layers: 2 stages of 2, or 4 virtual stages of 1."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="20KB")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stream")
    for kind in ("llama", "qwen3_moe"):
        save_tiny_pretrained(kind, root / kind)
    _save_llama4(root / "llama4")
    out = run_ranks(_ranks, 2, str(root), timeout_s=300)
    return {**out, **run_ranks(_ranks, 4, str(root), timeout_s=300)}


ALL = [*LAYOUTS, *(name for names in PIPELINES.values() for name in names)]


@pytest.mark.parametrize("layout", ALL)
def test_every_rank_streams_the_export_bit_for_bit(runs, layout):
    run = runs[layout]
    exported = read_safetensors(run["export"])
    for rank, buckets in enumerate(run["buckets"]):
        streamed = [pair for bucket in buckets for pair in bucket]
        names = [name for name, _ in streamed]
        assert len(names) == len(set(names)), rank
        assert set(names) == set(exported), rank
        for name, tensor in streamed:
            assert tensor.dtype == exported[name].dtype, (rank, name)
            assert torch.equal(tensor, exported[name]), (rank, name)
        if "ep2" in layout:  # per-expert keys, as save_pretrained writes them
            assert any(".experts.3." in name for name in names)
        if layout == "lora":  # merged under the base's names
            assert not any("lora_" in name or "base_layer" in name for name in names)


@pytest.mark.parametrize("layout", ALL)
def test_each_bucket_is_within_its_bound(runs, layout):
    for buckets in runs[layout]["buckets"]:
        assert len(buckets) > 2
        for bucket in buckets:
            size = sum(t.nbytes for _, t in bucket)
            assert size <= BUCKET or len(bucket) == 1, [(n, t.nbytes) for n, t in bucket]


@pytest.mark.parametrize("layout", [name for names in PIPELINES.values() for name in names])
def test_a_stage_holds_only_its_layers(runs, layout):
    """What makes the pipeline cases real: rank 0 (stage 0) holds no head
    (the last stage's) and received it."""
    run = runs[layout]
    assert run["held"] and "lm_head.weight" not in run["held"], run["held"]
    assert any(name == "lm_head.weight" for bucket in run["buckets"][0] for name, _ in bucket)
