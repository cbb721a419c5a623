"""The vLLM rollout engine in its own Python environment, as a Ray actor:
after a weight sync (HF-named buckets, as ``ctx.stream_weights`` yields
them) its greedy tokens equal transformers' greedy decode of the synced
model and its sampled tokens' log-probs are within fp32 rounding of
transformers' ``log_softmax`` (the gap is printed). The same after an
adapter-only sync (``rollout.sync: adapters``: the LoRA adapters as
``ctx.stream_weights(model, adapters=True)`` yields them, applied by vLLM
as a ``LoRARequest``), against the merged model. After a collective
sync (``rollout.transport: collective``: the buckets broadcast over a gloo
weight group into vLLM's worker) its greedy tokens equal transformers' too.

Opt-in: vLLM needs its own environment (``bash .ci/vllm_venv.sh``, about
4 GB and minutes to install; its engine takes about 90 s to start on 2
loaded cores), named by ``RFB_VLLM_PYTHON``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.e2e
PYTHON = os.environ.get("RFB_VLLM_PYTHON")
if not PYTHON:
    pytest.skip("set RFB_VLLM_PYTHON to a vLLM environment's python", allow_module_level=True)
transformers = pytest.importorskip("transformers")

PROMPTS = [[2, 10, 11, 12], [2, 20, 21]]


def tiny_llama(path) -> str:
    """A tiny chat Llama vLLM's CPU attention takes (head_dim 64)."""
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_tokenizer

    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, vocab_size=96, max_position_embeddings=256,
        initializer_range=0.16, bos_token_id=2, eos_token_id=3, pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    save_tiny_tokenizer(path, chat=True)
    return str(path)


def _engine_and_trained_model(tmp_path):
    """A vLLM engine actor on the tiny Llama's checkpoint, and that model in
    transformers with its weights moved (what a sync must carry)."""
    import ray

    from ray_fsdp_backend.rl import rollout_vllm
    from ray_fsdp_backend.trainer.loop.grpo import engine_environment

    path = tiny_llama(tmp_path / "llama")
    env = engine_environment(rollout_vllm, PYTHON)
    engine = ray.remote(rollout_vllm.VLLMRollout).options(num_cpus=0, runtime_env=env)
    engine = engine.remote(path, dtype="float32")
    trained = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return engine, trained


def _assert_greedy_as(engine, trained) -> None:
    """The engine, synced as weight version 1, decodes greedily as ``trained``."""
    import ray

    greedy = ray.get(engine.generate.remote(PROMPTS, max_tokens=8, temperature=0.0))
    assert greedy["version"] == 1
    for prompt, (sample,) in zip(PROMPTS, greedy["samples"], strict=True):
        expected = trained.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, pad_token_id=3
        )[0, len(prompt) :].tolist()
        assert sample["token_ids"] == expected[: len(sample["token_ids"])]


def test_synced_vllm_engine_decodes_as_the_trainer_model(tmp_path, ray_local):
    import ray

    engine, trained = _engine_and_trained_model(tmp_path)
    state = list(trained.state_dict().items())
    for start in range(0, len(state), 5):
        ray.get(engine.load_weights.remote(state[start : start + 5]))
    ray.get(engine.finish_sync.remote(1))
    _assert_greedy_as(engine, trained)
    sampled = ray.get(engine.generate.remote(PROMPTS, n=2, max_tokens=8, temperature=0.8, seed=1))
    gap = _log_prob_gap(trained, sampled["samples"], 0.8)
    print(f"vLLM vs transformers log-prob gap after a sync: {gap:.2e} nats (fp32)")
    assert gap < 1e-3


def test_adapter_synced_vllm_engine_decodes_as_the_merged_model(tmp_path, ray_local):
    """Two adapter syncs (the second's adapter replaces the first's: a new
    ``LoRARequest`` id), then greedy tokens equal the merged policy's and
    the sampled log-probs are within fp32 rounding of it, away from the base."""
    import ray
    from peft import LoraConfig, get_peft_model

    from ray_fsdp_backend.hf.adapter_stream import stream_adapters
    from ray_fsdp_backend.rl import rollout_vllm
    from ray_fsdp_backend.trainer.loop.grpo import engine_environment

    path = tiny_llama(tmp_path / "llama")
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]  # qkv / gate_up: partly
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    env = engine_environment(rollout_vllm, PYTHON)
    engine = ray.remote(rollout_vllm.VLLMRollout).options(num_cpus=0, runtime_env=env)
    engine = engine.remote(path, dtype="float32", lora=lora)
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    policy = get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(path), LoraConfig(**lora)
    )
    sent = 0
    for version in (1, 2):
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn_like(p) * 0.15)
        for bucket in stream_adapters(policy, bucket_bytes=16 * 1024):
            sent += ray.get(engine.load_weights.remote(bucket))
        ray.get(engine.finish_sync.remote(version))
    merged = policy.merge_and_unload().eval()
    merged_bytes = sum(t.nbytes for t in merged.state_dict().values())
    print(f"adapter syncs: {sent // 2:,} bytes each (merged model: {merged_bytes:,} bytes)")
    greedy = ray.get(engine.generate.remote(PROMPTS, max_tokens=8, temperature=0.0))
    assert greedy["version"] == 2
    for prompt, (sample,) in zip(PROMPTS, greedy["samples"], strict=True):
        expected = merged.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, pad_token_id=3
        )[0, len(prompt) :].tolist()
        assert sample["token_ids"] == expected[: len(sample["token_ids"])]
    sampled = ray.get(engine.generate.remote(PROMPTS, n=2, max_tokens=8, temperature=0.8, seed=1))
    gap = _log_prob_gap(merged, sampled["samples"], 0.8)
    print(f"vLLM (adapters) vs transformers (merged) log-prob gap: {gap:.2e} nats (fp32)")
    assert gap < 1e-3
    assert _log_prob_gap(base, sampled["samples"], 0.8) > 1e-2  # the adapter is applied


def _log_prob_gap(model, samples: list, temperature: float) -> float:
    """The largest |transformers - engine| log-prob of the sampled tokens."""
    gaps = []
    for prompt, group in zip(PROMPTS, samples, strict=True):
        for sample in group:
            ids = torch.tensor([prompt + sample["token_ids"]])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
            ours = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(sample["token_ids"]).unsqueeze(-1)
            )
            gaps.append((ours.squeeze(-1) - torch.tensor(sample["log_probs"])).abs().max())
    return float(torch.stack(gaps).max())


def test_a_collective_sync_over_gloo_makes_vllm_decode_as_the_trainer_model(tmp_path, ray_local):
    """``rollout.transport: collective`` into vLLM's worker: the weight group
    (gloo on CPU) between this process, as the trainer's rank 0, and the
    engine's worker; the buckets broadcast there, reloaded once at the end."""
    import ray

    from ray_fsdp_backend.rl.fleet import RolloutFleet

    engine, trained = _engine_and_trained_model(tmp_path)
    fleet = RolloutFleet([engine], transport="collective")
    state = list(trained.state_dict().items())
    for start in range(0, len(state), 5):
        fleet.transport.put(state[start : start + 5])
    fleet.transport.finish()
    assert fleet.transport.group.address.backend == "gloo"
    ray.get(engine.finish_sync.remote(1))
    _assert_greedy_as(engine, trained)
