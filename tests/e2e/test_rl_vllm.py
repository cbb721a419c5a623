"""The vLLM rollout engine in its own Python environment, as a Ray actor:
after a weight sync (HF-named buckets, as ``ctx.stream_weights`` yields
them) its greedy tokens equal transformers' greedy decode of the synced
model and its sampled tokens' log-probs are within fp32 rounding of
transformers' ``log_softmax`` (the gap is printed).

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


def test_synced_vllm_engine_decodes_as_the_trainer_model(llama_path, engine):
    import ray

    trained = transformers.AutoModelForCausalLM.from_pretrained(llama_path).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    state = list(trained.state_dict().items())
    for start in range(0, len(state), 5):
        ray.get(engine.load_weights.remote(state[start : start + 5]))
    version = ray.get(engine.get_version.remote()) + 1
    ray.get(engine.finish_sync.remote(version))
    greedy = ray.get(engine.generate.remote(PROMPTS, max_tokens=8, temperature=0.0))
    assert greedy["version"] == version
    for prompt, (sample,) in zip(PROMPTS, greedy["samples"], strict=True):
        expected = trained.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, pad_token_id=3
        )[0, len(prompt) :].tolist()
        assert sample["token_ids"] == expected[: len(sample["token_ids"])]
    sampled = ray.get(engine.generate.remote(PROMPTS, n=2, max_tokens=8, temperature=0.8, seed=1))
    gaps = []
    for prompt, group in zip(PROMPTS, sampled["samples"], strict=True):
        for sample in group:
            ids = torch.tensor([prompt + sample["token_ids"]])
            with torch.no_grad():
                logits = trained(ids).logits[0, len(prompt) - 1 : -1] / 0.8
            ours = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(sample["token_ids"]).unsqueeze(-1)
            )
            gaps.append((ours.squeeze(-1) - torch.tensor(sample["log_probs"])).abs().max())
    gap = float(torch.stack(gaps).max())
    print(f"vLLM vs transformers log-prob gap after a sync: {gap:.2e} nats (fp32)")
    assert gap < 1e-3
