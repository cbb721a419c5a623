"""The transformers rollout engine on a tiny chat Llama: its samples'
log-probs are the sampling distribution's, seeded, cut at the end of
sequence; a weight sync in buckets makes it the synced model; it, the vLLM
engine and the weight group's code they receive by value import nothing of
the package (they may run in an environment of its own)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from ray_fsdp_backend.rl import rollout_hf, rollout_vllm, weight_group
from ray_fsdp_backend.rl.rollout_hf import HFRollout
from tests.hf_models import save_tiny_pretrained

transformers = pytest.importorskip("transformers")

PROMPTS = [[2, 10, 11, 12], [2, 20, 21]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_pretrained("llama", tmp_path_factory.mktemp("tiny"), chat=True)


@pytest.fixture(scope="module")
def engine(path):
    return HFRollout(path)


def test_log_probs_are_the_sampling_distributions(engine, path):
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    out = engine.generate(PROMPTS, n=3, max_tokens=12, temperature=0.7, seed=1)["samples"]
    assert [len(samples) for samples in out] == [3, 3]
    for prompt, samples in zip(PROMPTS, out, strict=True):
        for sample in samples:
            ids = torch.tensor([prompt + sample["token_ids"]])
            with torch.no_grad():
                logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits / 0.7, -1).gather(
                -1, torch.tensor(sample["token_ids"]).unsqueeze(-1)
            )
            torch.testing.assert_close(
                torch.tensor(sample["log_probs"]), expected.squeeze(-1), rtol=1e-5, atol=1e-5
            )


def test_samples_are_seeded_and_end_at_the_end_of_sequence(engine):
    first = engine.generate(PROMPTS, n=4, max_tokens=20, seed=3)["samples"]
    assert engine.generate(PROMPTS, n=4, max_tokens=20, seed=3)["samples"] == first
    assert engine.generate(PROMPTS, n=4, max_tokens=20, seed=4)["samples"] != first
    samples = [s for group in first for s in group]
    for sample in samples:
        ids = sample["token_ids"]
        assert len(ids) == len(sample["log_probs"]) <= 20
        assert (ids[-1] == 3) == sample["finished"]  # <|im_end|>, the tiny chat model's eos
        assert 3 not in ids[:-1]
    assert len({tuple(s["token_ids"]) for s in samples}) > 1  # sampled, not greedy


def test_weights_synced_in_buckets_make_it_the_synced_model(path):
    engine = HFRollout(path)
    trained = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    state = list(trained.state_dict().items())
    for start in range(0, len(state), 4):  # buckets of 4 tensors
        engine.load_weights(state[start : start + 4])
    engine.finish_sync(1)
    assert engine.get_version() == 1
    greedy = engine.generate(PROMPTS, max_tokens=10, temperature=0)
    assert greedy["version"] == 1
    greedy = greedy["samples"]
    for prompt, (sample,) in zip(PROMPTS, greedy, strict=True):
        ids = torch.tensor([prompt])
        expected = trained.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=3)
        response = expected[0, len(prompt) :].tolist()
        assert sample["token_ids"] == response[: len(sample["token_ids"])]
    with pytest.raises(KeyError, match="weights this model does not have"):
        engine.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])


@pytest.mark.parametrize(
    "module", [rollout_hf, rollout_vllm, weight_group], ids=lambda m: m.__name__.rsplit(".")[-1]
)
def test_the_engine_imports_nothing_of_the_package(module):
    tree = ast.parse(inspect.getsource(module))
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {m for m in imported if m and m.startswith("ray_fsdp_backend")}, imported


def test_a_colocated_cycle_leaves_the_samples_as_they_were(engine):
    """The colocated loop's calls (sleep after a rollout, the weights woken
    for a sync, the KV cache for the next rollout): on CPU they release
    nothing (the weights are host memory already) and change nothing."""
    before = engine.generate(PROMPTS, n=2, max_tokens=8, seed=5)
    engine.sleep()
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    engine.sleep()
    engine.wake_up()
    assert engine.generate(PROMPTS, n=2, max_tokens=8, seed=5) == before
