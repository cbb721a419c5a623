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
A prompt longer than one KV block, sampled before a sync, is decoded with
the new weights after it (the engine drops its prefix cache on reload).

vLLM needs its own environment (``bash .ci/vllm_venv.sh DIR``, about 3.5 GB
and 2 minutes to install), named by ``RFB_VLLM_PYTHON``; without it the
module skips, unless ``RFB_REQUIRE_VLLM=1`` (``.ci/run`` sets both), which
makes the missing environment a failure. Its engine takes about 90 s to
start on 2 loaded cores: the module starts one (:func:`engine`) and its
tests share it.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.e2e
PYTHON = os.environ.get("RFB_VLLM_PYTHON")
if not PYTHON and os.environ.get("RFB_REQUIRE_VLLM") == "1":
    pytest.fail(
        "RFB_REQUIRE_VLLM=1 but RFB_VLLM_PYTHON is not set: build a vLLM environment "
        "with `bash .ci/vllm_venv.sh DIR` and set RFB_VLLM_PYTHON=DIR/bin/python",
        pytrace=False,
    )
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


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("rl_vllm") / "llama")


@pytest.fixture(scope="module")
def engine(llama_path, ray_local):
    """The module's one vLLM engine actor on ``llama_path``, in the vLLM
    environment; a test that syncs weights finishes the sync at
    ``get_version() + 1``, so the tests run in any order."""
    import ray

    from ray_fsdp_backend.rl import rollout_vllm
    from ray_fsdp_backend.trainer.loop.grpo import engine_environment

    env = engine_environment(rollout_vllm, PYTHON)
    actor = ray.remote(rollout_vllm.VLLMRollout).options(num_cpus=0, runtime_env=env)
    actor = actor.remote(llama_path, dtype="float32")
    yield actor
    ray.kill(actor)


LONG_PROMPT = [2] + [10 + (i * 7) % 80 for i in range(199)]  # 200 tokens: a full KV block


def _trained(llama_path: str, seed: int):
    """The tiny Llama in transformers with its weights moved (what a sync must carry)."""
    trained = transformers.AutoModelForCausalLM.from_pretrained(llama_path).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return trained


def _assert_greedy_as(engine, model, version: int, prompts=PROMPTS) -> None:
    """The engine, at weight ``version``, decodes ``prompts`` greedily as ``model``."""
    import ray

    greedy = ray.get(engine.generate.remote(prompts, max_tokens=8, temperature=0.0))
    assert greedy["version"] == version
    for prompt, (sample,) in zip(prompts, greedy["samples"], strict=True):
        expected = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, pad_token_id=3
        )[0, len(prompt) :].tolist()
        assert sample["token_ids"] == expected[: len(sample["token_ids"])]


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


def test_synced_vllm_engine_decodes_as_the_trainer_model(llama_path, engine):
    import ray

    ray.get(engine.generate.remote([LONG_PROMPT], max_tokens=8, temperature=0.0))  # cached
    trained = _trained(llama_path, seed=1)
    state = list(trained.state_dict().items())
    for start in range(0, len(state), 5):
        ray.get(engine.load_weights.remote(state[start : start + 5]))
    version = ray.get(engine.get_version.remote()) + 1
    ray.get(engine.finish_sync.remote(version))
    _assert_greedy_as(engine, trained, version, [*PROMPTS, LONG_PROMPT])
    sampled = ray.get(engine.generate.remote(PROMPTS, n=2, max_tokens=8, temperature=0.8, seed=1))
    gap = _log_prob_gap(trained, sampled["samples"], 0.8)
    print(f"vLLM vs transformers log-prob gap after a sync: {gap:.2e} nats (fp32)")
    assert gap < 1e-3


def test_a_collective_sync_over_gloo_makes_vllm_decode_as_the_trainer_model(llama_path, engine):
    """``rollout.transport: collective`` into vLLM's worker: the weight group
    (gloo on CPU) between this process, as the trainer's rank 0, and the
    engine's worker; the buckets broadcast there, reloaded once at the end."""
    import ray

    from ray_fsdp_backend.rl.fleet import RolloutFleet

    trained = _trained(llama_path, seed=2)
    fleet = RolloutFleet([engine], transport="collective")
    state = list(trained.state_dict().items())
    for start in range(0, len(state), 5):
        fleet.transport.put(state[start : start + 5])
    fleet.transport.finish()
    assert fleet.transport.group.address.backend == "gloo"
    version = ray.get(engine.get_version.remote()) + 1
    ray.get(engine.finish_sync.remote(version))
    _assert_greedy_as(engine, trained, version)


def test_adapter_synced_vllm_engine_decodes_as_the_merged_model(llama_path, ray_local):
    """Two adapter syncs (the second's adapter replaces the first's: a new
    ``LoRARequest`` id), then greedy tokens equal the merged policy's and
    the sampled log-probs are within fp32 rounding of it, away from the base.
    Its own engine: one built for adapters applies them to its base."""
    import ray
    from peft import LoraConfig, get_peft_model

    from ray_fsdp_backend.hf.adapter_stream import stream_adapters
    from ray_fsdp_backend.rl import rollout_vllm
    from ray_fsdp_backend.trainer.loop.grpo import engine_environment

    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]  # qkv / gate_up: partly
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    env = engine_environment(rollout_vllm, PYTHON)
    engine = ray.remote(rollout_vllm.VLLMRollout).options(num_cpus=0, runtime_env=env)
    engine = engine.remote(llama_path, dtype="float32", lora=lora)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_path).eval()
    policy = get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(llama_path), LoraConfig(**lora)
    )
    sent = 0
    try:
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
        _assert_greedy_as(engine, merged, 2)
        sampled = ray.get(
            engine.generate.remote(PROMPTS, n=2, max_tokens=8, temperature=0.8, seed=1)
        )
        gap = _log_prob_gap(merged, sampled["samples"], 0.8)
        print(f"vLLM (adapters) vs transformers (merged) log-prob gap: {gap:.2e} nats (fp32)")
        assert gap < 1e-3
        assert _log_prob_gap(base, sampled["samples"], 0.8) > 1e-2  # the adapter is applied
    finally:
        ray.kill(engine)


def test_the_grpo_yaml_loop_samples_on_a_vllm_engine(llama_path, ray_address, tmp_path):
    """``ray-fsdp train examples/grpo.yaml`` with ``rollout.engine: vllm``
    (the engine started by the loop in its own environment, the LoRA-merged
    weights synced through the object store after every step): the run
    finishes, and each step's log-prob gap between the trainer and the
    engine on the sampled tokens, measured before that step's update, is
    fp32 rounding: the engine sampled with the weights the last sync sent."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from ray_fsdp_backend.rl.example_task import main as write_prompts
    from tests.conftest import ray_env

    repo = Path(__file__).resolve().parents[2]
    write_prompts([str(tmp_path / "prompts.jsonl")])
    steps = 3
    overrides = [
        f"model.pretrained={llama_path}",
        f"data.path={tmp_path / 'prompts.jsonl'}",
        f"run.storage_path={tmp_path / 'runs'}",
        "rollout.engine=vllm",
        f"rollout.python={PYTHON}",
        "rollout.max_tokens=8",
        "train.grpo.group_size=4",
        "train.grpo.prompts_per_step=2",
        "train.micro_batch_size=4",
        f"train.steps={steps}",
        "train.log_every=1",
    ]
    command = [sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/grpo.yaml"]
    for item in overrides:
        command += ["--set", item]
    env = ray_env(
        ray_address, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("metrics:"))
    history = [json.loads(r) for r in Path(line.split(":", 1)[1].strip()).read_text().splitlines()]
    assert [row["step"] for row in history] == list(range(1, steps + 1))
    gaps = [row["log_prob_gap"] for row in history]
    print("trainer / vLLM log-prob gap per step:", " ".join(f"{g:.2e}" for g in gaps))
    assert all(row["sync_bytes"] > 0 for row in history)
    assert max(gaps) < 1e-4
