"""An adapter-only weight sync (``rollout.sync: adapters``) on 2 gloo ranks
into real transformers rollout engines (Ray actors): a LoRA policy under
FSDP2 is trained, then ``sync_weights(..., adapters=True)`` sends its
adapters to an engine built with the run's LoRA config, and the default
sync sends the merged model to a plain engine; twice (the second sync
replaces the first's adapters). The adapter engine's greedy tokens and
sampled log-probs equal the trainer's merged model's (its merged export,
``log_softmax`` in one process) and the merged engine's (fp32, 1e-5); the
streamed adapters are ``export_model(format="peft")``'s tensors bit for
bit; the bytes sent are the adapters' (both sizes printed)."""

from __future__ import annotations

import os

import pytest
import torch

from ray_fsdp_backend import FSDPSettings, load_pretrained
from ray_fsdp_backend.hf import export_model
from ray_fsdp_backend.hf.models import build_causal_lm
from ray_fsdp_backend.rl.fleet import RolloutFleet, sync_weights
from ray_fsdp_backend.rl.rollout_hf import HFRollout
from ray_fsdp_backend.runtime.worker import setup_process_context
from tests.dist.harness import run_ranks
from tests.hf_models import fine_tune, read_safetensors, save_tiny_pretrained

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
PROMPTS = [[2, 10, 11, 12], [2, 20, 21]]
BUCKET = 4 * 1024  # bytes: several buckets of adapters
SAMPLING = dict(n=3, max_tokens=12, temperature=0.8, seed=5)


def _ranks(rank: int, world: int, path: str, address: str, root: str) -> dict:
    from peft import LoraConfig, get_peft_model

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    ctx = setup_process_context(
        FSDPSettings(use_fsdp=True, use_mixed_precision=False), torch.device("cpu")
    )
    model = ctx.wrap(get_peft_model(build_causal_lm(path), LoraConfig(**LORA)))
    load_pretrained(model, path)
    fleets = None
    if rank == 0:
        import ray

        ray.init(address=address, log_to_driver=False)
        engine = ray.remote(HFRollout).options(num_cpus=0)
        fleets = {
            "adapters": RolloutFleet([engine.remote(path, lora=LORA)]),
            "merged": RolloutFleet([engine.remote(path)]),
        }
    out = {}
    for _ in range(2):  # the second sync's adapters replace the first's
        fine_tune(model, rank, world)  # trained: lora_B is no longer zero
        for name in ("adapters", "merged"):
            fleet = fleets[name] if fleets else None
            stats = sync_weights(
                ctx, model, fleet, bucket_bytes=BUCKET, adapters=name == "adapters"
            )
            out[f"{name}_bytes"] = stats.bytes
    out["buckets"] = [
        list(b) for b in ctx.stream_weights(model, bucket_bytes=BUCKET, adapters=True)
    ]
    for fmt in ("peft", "hf"):
        export_model(model, os.path.join(root, fmt), format=fmt)
    if fleets is not None:
        import ray

        for name, fleet in fleets.items():
            out[f"{name}_versions"] = [
                fleet.version,
                ray.get(fleet.engines[0].get_version.remote()),
            ]
            out[f"{name}_greedy"] = fleet.generate(PROMPTS, seed=0, max_tokens=12, temperature=0)
            out[f"{name}_sampled"] = fleet.generate(PROMPTS, **SAMPLING)
        ray.shutdown()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_address):
    root = tmp_path_factory.mktemp("adapter_sync")
    path = save_tiny_pretrained("llama", root / "llama", chat=True)
    return root, run_ranks(_ranks, 2, path, ray_address, str(root), timeout_s=300)


def test_streamed_adapters_are_the_peft_export_bit_for_bit(run):
    root, out = run
    exported = read_safetensors(str(root / "peft"))
    streamed = [pair for bucket in out["buckets"] for pair in bucket]
    assert [name for name, _ in streamed] == list(dict(streamed))  # no name twice
    assert dict(streamed).keys() == exported.keys()
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n, _ in streamed)
    for name, tensor in streamed:
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name
    assert len(out["buckets"]) > 2
    for bucket in out["buckets"]:
        assert sum(t.nbytes for _, t in bucket) <= BUCKET or len(bucket) == 1


def test_the_bytes_sent_are_the_adapters(run):
    root, out = run
    adapters = sum(t.nbytes for t in read_safetensors(str(root / "peft")).values())
    merged = sum(t.nbytes for t in read_safetensors(str(root / "hf")).values())
    print(f"sync bytes: adapters {out['adapters_bytes']:,}, merged {out['merged_bytes']:,}")
    assert out["adapters_bytes"] == adapters
    assert out["merged_bytes"] == merged
    assert adapters * 2 < merged


def test_the_adapter_engine_decodes_as_the_merged_model(run):
    """Greedy tokens and sampled log-probs: the adapter-synced engine, the
    merged-synced engine and the trainer's merged model (its export) agree."""
    root, out = run
    assert out["adapters_versions"] == out["merged_versions"] == [2, 2]
    trained = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "llama").eval()
    _assert_same(out["adapters_greedy"], out["merged_greedy"])
    _assert_same(out["adapters_sampled"], out["merged_sampled"])
    greedy = [s for (s,) in out["adapters_greedy"]]
    for prompt, sample in zip(PROMPTS, greedy, strict=True):
        ids = torch.tensor([prompt])
        expected = trained.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=3)
        assert (
            sample["token_ids"] == expected[0, len(prompt) :].tolist()[: len(sample["token_ids"])]
        )
    changed = False
    for prompt, group in zip(PROMPTS, out["adapters_sampled"], strict=True):
        for sample in group:
            ids = torch.tensor([prompt + sample["token_ids"]])
            tokens = torch.tensor(sample["token_ids"]).unsqueeze(-1)
            picked = {}
            with torch.no_grad():
                for name, model in (("trained", trained), ("base", base)):
                    logits = model(ids).logits[0, len(prompt) - 1 : -1] / SAMPLING["temperature"]
                    picked[name] = torch.log_softmax(logits, -1).gather(-1, tokens).squeeze(-1)
            got = torch.tensor(sample["log_probs"])
            torch.testing.assert_close(got, picked["trained"], rtol=1e-5, atol=1e-5)
            changed |= (got - picked["base"]).abs().max().item() > 1e-3
    assert changed  # the adapters moved the policy away from the base


def test_an_adapter_engine_takes_only_adapter_names(tmp_path):
    path = save_tiny_pretrained("llama", tmp_path / "llama", chat=True)
    engine = HFRollout(path, lora=LORA)
    plain = HFRollout(path)
    _assert_same(  # lora_B zero: the base
        engine.generate(PROMPTS, **SAMPLING)["samples"],
        plain.generate(PROMPTS, **SAMPLING)["samples"],
    )
    with pytest.raises(KeyError, match="weights this model does not have"):
        engine.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))])


def _assert_same(samples: list, expected: list) -> None:
    """The same tokens, log-probs within fp32 rounding (1e-5)."""
    for group, expected_group in zip(samples, expected, strict=True):
        for sample, other in zip(group, expected_group, strict=True):
            assert sample["token_ids"] == other["token_ids"]
            torch.testing.assert_close(
                torch.tensor(sample["log_probs"]), torch.tensor(other["log_probs"]),
                rtol=1e-5, atol=1e-5,
            )  # fmt: skip
