"""``train.objective: grpo`` before Ray starts: the sections and rules name
what is wrong; the prompt records are checked every one (``FILE:LINE``);
rewards are loaded and checked; the prompt order resumes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_fsdp_backend.rl.rewards import call_reward, load_reward
from ray_fsdp_backend.settings.policy import PolicyOptions
from ray_fsdp_backend.trainer.loop.grpo import PromptSampler
from ray_fsdp_backend.trainer.schema.spec import check_spec, load_yaml

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained
    from ray_fsdp_backend.rl.example_task import prompt_records

    root = tmp_path_factory.mktemp("grpo")
    model = save_tiny_pretrained("llama", root / "model", chat=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_records(copies=8)))
    doc = load_yaml(EXAMPLE)
    doc["model"]["pretrained"], doc["data"]["path"] = model, str(prompts)
    return doc, root


def test_the_example_passes(setup):
    doc, _ = setup
    assert check_spec(doc) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"train": {"grpo": {"group_size": 1}}}, "train: grpo.group_size=1 must be an int >= 2"),
        ({"train": {"grpo": {"clip_lo": 0.2}}}, "did you mean 'clip_low'"),
        ({"train": {"grpo": {"normalisation": "mean"}}}, "is not one of token, sequence, fixed"),
        ({"train": {"grpo": {"kl_bias_correction": "yes"}}}, "must be true or false"),
        ({"rollout": {"engine": "sglang"}}, "rollout.engine='sglang' is not one of hf, vllm"),
        ({"rollout": {"temperature": 0}}, "rollout.temperature=0 must be a positive number"),
        ({"rollout": {"bucket_bytes": "lots"}}, "rollout.bucket_bytes='lots' is not a positive"),
        (
            {"rollout": {"transport": "nccl"}},
            "rollout.transport='nccl' is not one of object_store, collective",
        ),
        ({"rollout": {"colocate": "yes"}}, "rollout.colocate='yes' must be true or false"),
        ({"reward": "no_colon"}, "reward.function='no_colon' must be 'module:function'"),
        ({"reward": None}, "train.objective='grpo' needs reward: module:function"),
        ({"data": {"format": "chat"}}, "train.objective='grpo' needs data.format='prompts'"),
        ({"distributed": {"pipeline_parallel_size": 2}}, "pipeline_parallel_size=2: not supported"),
        ({"rollout": {"sync": "lora"}}, "rollout.sync='lora' is not one of merged, adapters"),
        (
            {
                "model": {"lora": None},
                "train": {"grpo": {"kl_coef": 0}},
                "rollout": {"sync": "adapters"},
            },
            "rollout.sync='adapters' needs model.lora",
        ),
        (
            {"rollout": {"sync": "adapters", "transport": "collective"}},
            "rollout.sync='adapters' with rollout.transport='collective'",
        ),
        (
            {"rollout": {"colocate": True, "transport": "collective", "num_gpus": 0.5}},
            "NCCL cannot join a trainer rank and an engine on one GPU",
        ),
    ],
    ids=lambda v: None if isinstance(v, dict) else v[:30],
)
def test_bad_settings_are_named(setup, change, message):
    doc, _ = setup
    doc = json.loads(json.dumps(doc))
    for section, values in change.items():
        if values is None or isinstance(values, str):
            doc[section] = values
            continue
        for key, value in values.items():
            target = doc.setdefault(section, {})
            if isinstance(value, dict):
                target.setdefault(key, {}).update(value)
            else:
                target[key] = value
    errors = check_spec({k: v for k, v in doc.items() if v is not None})
    assert any(message in e for e in errors), errors


def test_plan_prints_the_fleet_and_the_sync(setup, tmp_path, capsys):
    from ray_fsdp_backend.cli.main import main

    doc, _ = setup
    config = tmp_path / "grpo.yaml"
    config.write_text(json.dumps(doc))
    assert main(["plan", str(config), "--nodes", "1", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "objective: grpo, 32 samples a step (4 prompts x group 8), token mean" in out
    assert "rollout:  1 hf engine(s) (Ray actors), each 1 CPU 0 GPU, responses up to 24" in out
    assert "sync:" in out and "in 1 bucket(s) of at most" in out
    merged = _sync_bytes(out)
    assert "(fp32, adapters merged)" in out
    assert "to each of 1 engine(s) through Ray's object store" in out
    collective = json.loads(json.dumps(doc))
    collective["rollout"]["transport"] = "collective"
    config.write_text(json.dumps(collective))
    assert main(["plan", str(config), "--nodes", "1", "--gpus-per-node", "2"]) == 0
    assert "broadcast over a weight group (NCCL on GPUs, else gloo)" in capsys.readouterr().out
    assert "colocated" not in out
    colocated = {**doc, "rollout": {**doc["rollout"], "colocate": True}}
    config.write_text(json.dumps(colocated))
    assert main(["plan", str(config), "--nodes", "1", "--gpus-per-node", "2"]) == 0
    assert "24 tokens, colocated (on the trainer's nodes, asleep" in capsys.readouterr().out
    doc = {**doc, "rollout": {**doc["rollout"], "sync": "adapters"}}
    config.write_text(json.dumps(doc))
    assert main(["plan", str(config), "--nodes", "1", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "(fp32, adapters alone) in 1 bucket(s)" in out
    # r 8 x (fan-in + fan-out) per adapted layer of the tiny Llama (hidden 32, kv 16, mlp 64):
    # q 64, k 48, v 48, o 64, gate 96, up 96, down 96 = 512 x 8 = 4096 a block, 2 blocks, fp32
    assert _sync_bytes(out) == 2 * 4096 * 4 < merged


def _sync_bytes(out: str) -> float:
    """The size ``plan``'s ``sync:`` line prints, in bytes."""
    number, unit = re.search(r"sync: +([0-9.]+) (\w+) a step", out).groups()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_rollout_sections_refused_without_grpo(setup):
    doc, _ = setup
    doc = json.loads(json.dumps(doc))
    doc["train"]["objective"] = "sft"
    errors = check_spec(doc)
    assert any("data.format='prompts' with train.objective='sft'" in e for e in errors)
    assert any("rollout: set only with train.objective: grpo" in e for e in errors)


def test_every_prompt_record_is_checked_before_ray(setup):
    """A bad record at line 25 of 40 (past any sample of the first ones) is
    named with its line by ``validate``, quickly, without importing Ray."""
    doc, root = setup
    lines = (Path(doc["data"]["path"]).read_text()).splitlines()
    bad = {
        25: "{not json",
        30: json.dumps({"question": "no prompt field"}),
        33: json.dumps({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                       "content": "x"}]}),
    }  # fmt: skip
    for line, text in bad.items():
        lines[line - 1] = text
    prompts = root / "bad.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    config = root / "bad.yaml"
    doc = {**doc, "data": {**doc["data"], "path": str(prompts)}}
    config.write_text(json.dumps(doc))
    code = (
        "import sys; from ray_fsdp_backend.cli.main import main; rc = main(sys.argv[1:]); "
        "assert 'ray' not in sys.modules, 'validate imported Ray'; sys.exit(rc)"
    )
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, "validate", str(config)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.perf_counter() - start < 60
    text = out.stdout + out.stderr
    assert f"{prompts}:25: " in text and "not valid JSON" in text or "JSON" in text, text
    assert f"{prompts}:30: no 'prompt' field" in text, text
    assert f"{prompts}:33: the prompt ends with an assistant turn" in text, text
    assert "3 prompt record(s)" in text


def test_rewards_are_loaded_and_checked():
    with pytest.raises(ValueError, match="reward='nope' must be 'module:function'"):
        load_reward("nope")
    with pytest.raises(ValueError, match="module 'no_such_module' does not import"):
        load_reward("no_such_module:f")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_reward("ray_fsdp_backend.rl.example_task:missing")
    entry = "ray_fsdp_backend.rl.example_task:letter_share"
    assert call_reward(entry, ["p", "p"], ["eee", "xyz"], {"letter": ["e", "e"]}) == [1.0, 0.0]
    here = "tests.unit.test_rl_config"
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        call_reward(f"{here}:one_reward", ["p", "p"], ["x", "y"], {})
    with pytest.raises(ValueError, match="returned non-finite values at completions"):
        call_reward(f"{here}:nan_rewards", ["p"], ["x"], {})
    with pytest.raises(ValueError, match="raised TypeError: .*'s'"):
        call_reward("json:loads", ["p"], ["x"], {})  # not a reward function: named


def one_reward(prompts, completions, **_):
    return [1.0]


def nan_rewards(prompts, completions, **_):
    return [float("nan")] * len(completions)


def test_prompt_order_is_seeded_covers_each_pass_and_resumes():
    options = PolicyOptions()
    sampler = PromptSampler(10, options.prompts_per_step, seed=3)
    steps = [sampler.next() for _ in range(5)]  # 20 prompts: two passes
    first_pass = [i for s in steps for i in s][:10]
    assert sorted(first_pass) == list(range(10))
    assert first_pass != list(range(10))
    resumed = PromptSampler(10, options.prompts_per_step, seed=3)
    resumed.load_state_dict({"position": 8})
    assert [resumed.next() for _ in range(3)] == steps[2:]
    assert PromptSampler(10, 4, seed=4).next() != steps[0]
