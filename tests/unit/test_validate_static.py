"""One static check for ``validate``, ``plan`` and ``train``: what ``train``
would refuse, ``validate`` names first, and nothing starts Ray.

Each broken config is run through all three commands; each must exit
non-zero naming the key, and ``ray.init`` is never called.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ray_fsdp_backend.cli.main import main
from ray_fsdp_backend.hf.check import check_pretrained
from ray_fsdp_backend.trainer.schema.preflight import cluster_errors, storage_errors
from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, check_spec, load_yaml

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init called: the config should have been refused first")

    monkeypatch.setattr(ray, "init", refuse)
    yield
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny Llama's ``config.json`` (the check reads nothing else)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(path)  # fmt: skip
    return str(path)


def _write(tmp_path, example: str, overrides: list[str]) -> str:
    path = tmp_path / f"{example}.yaml"
    doc = apply_overrides(load_yaml(EXAMPLES / f"{example}.yaml"), overrides)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _broken(tmp_path, tiny_llama):
    """(example, overrides, fragment naming the key) for each breakage."""
    empty = tmp_path / "empty-dir"
    empty.mkdir(exist_ok=True)
    old_export = tmp_path / "old-export"
    old_export.mkdir(exist_ok=True)
    (old_export / "model.safetensors").write_bytes(b"weights of another run")
    return [
        ("finetune_hf",
         [f"model.pretrained={tiny_llama}", f"model.export={old_export}",
          "model.export_overwrite=false"],
         f"model.export={str(old_export)!r} is not empty (model.safetensors)"),
        ("finetune_hf", ["model.pretrained=/no/such/llama"],
         "model.pretrained='/no/such/llama': directory not found"),
        ("finetune_hf", [f"model.pretrained={empty}"], "config.json not found"),
        ("finetune_lora",
         [f"model.pretrained={tiny_llama}", "model.lora.target_modules=[q, v_proj]"],
         "model.lora.target_modules=['q', 'v_proj']: ['q'] match no linear layer"),
        ("cpu_tiny", ["train.stesp=3"], "did you mean 'steps'"),
        ("cpu_tiny",
         ["distributed.use_fsdp=true", "distributed.pipeline_parallel_size=2",
          "distributed.tensor_parallel_size=2", "distributed.loss_parallel=true"],
         "loss_parallel=true with pipeline_parallel_size=2 is not supported"),
    ]  # fmt: skip


def test_validate_plan_and_train_refuse_each_broken_config_alike(
    tmp_path, tiny_llama, capsys, no_ray
):
    for example, overrides, fragment in _broken(tmp_path, tiny_llama):
        config = _write(tmp_path, example, overrides)
        runs = tmp_path / "runs"
        assert main(["validate", config]) == 1
        out = capsys.readouterr().out
        assert fragment in out, out
        plan = ["plan", config, "--nodes", "1", "--gpus-per-node", "2"]
        assert main(plan) == 2 and fragment in capsys.readouterr().err
        train = ["train", config, "--set", f"run.storage_path={runs}"]
        assert main(train) == 2 and fragment in capsys.readouterr().err
        assert not runs.exists()


def test_a_checkpoint_that_exists_passes(tiny_llama):
    assert check_pretrained(tiny_llama, lora_targets=["q_proj", "v_proj"]) == []


def test_object_store_checkpoint_not_found_and_found(s3_server, tiny_llama, monkeypatch):
    """Through ``pyarrow.fs`` against a real S3 API (moto): a URI with no
    checkpoint is "not found"; once ``config.json`` is there it passes."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    fs = s3_server.filesystem()
    fs.create_dir("ckpts")
    uri = f"s3://ckpts/llama?endpoint_override={s3_server.endpoint}&scheme=http&region=us-east-1"
    errors = check_pretrained(uri)
    assert len(errors) == 1 and "not found" in errors[0], errors
    with fs.open_output_stream("ckpts/llama/config.json") as f:
        f.write((Path(tiny_llama) / "config.json").read_bytes())
    assert check_pretrained(uri, lora_targets=["q_proj"]) == []


# -- the model's config.json, the examples run twice, the cluster ------------
# What validate, plan and train refuse from the model's shapes (meta models of
# tiny configs), one error a line naming the key; every example validates
# again after a previous run's export exists; YAML numbers as users write
# them; the cluster check train runs before the trainer is built.


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    """``config.json`` of each tiny kind the examples use (the checks read nothing else)."""
    from ray_fsdp_backend.models.tiny_pretrained import tiny_config

    root = tmp_path_factory.mktemp("configs")
    out = {}
    for kind in ("llama", "llama_qlora", "qwen3_moe"):
        tiny_config(kind).save_pretrained(root / kind)
        out[kind] = str(root / kind)
    from transformers import LlamaConfig

    odd = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=3)  # fmt: skip
    odd.save_pretrained(root / "odd")
    out["odd"] = str(root / "odd")
    return out


def _all_three(tmp_path, capsys, example: str, overrides: list[str], nodes=(1, 2)) -> list[str]:
    """Run validate, plan and train on the config; each must refuse it. Returns
    validate's error lines (the others print the same lines)."""
    path = tmp_path / f"{example}.yaml"
    path.write_text(yaml.safe_dump(apply_overrides(load_yaml(EXAMPLES / f"{example}.yaml"),
                                                   overrides)))  # fmt: skip
    assert main(["validate", str(path)]) == 1
    lines = [ln[4:] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  - ")]
    plan = ["plan", str(path), "--nodes", str(nodes[0]), "--gpus-per-node", str(nodes[1])]
    assert main(plan) == 2
    err = capsys.readouterr()
    assert "1/3" not in err.out and all(line in err.err for line in lines), err
    runs = tmp_path / "runs"
    assert main(["train", str(path), "--set", f"run.storage_path={runs}"]) == 2
    err = capsys.readouterr().err
    assert all(line in err for line in lines), err
    assert not runs.exists()
    return lines


def test_ep_that_does_not_divide_the_experts_is_refused_everywhere(
    tmp_path, capsys, configs, no_ray
):
    # Qwen3-MoE, 4 experts a layer, at ep 3: plan once said "each rank holds 1/3".
    lines = _all_three(tmp_path, capsys, "moe_ep", [
        f"model.pretrained={configs['qwen3_moe']}", "model.export=null",
        "distributed.expert_parallel_size=3", "scaling.num_workers=3",
    ], nodes=(1, 3))  # fmt: skip
    assert lines == [
        "distributed.expert_parallel_size=3 does not divide the 4 experts of "
        "model.layers.*.mlp.experts (2 MoE layers): every ep rank holds the same number of "
        "experts; use an expert_parallel_size that divides 4"
    ]


def test_plan_of_an_hf_config_refuses_ep_against_its_experts(capsys, configs):
    config = str(Path(configs["qwen3_moe"]) / "config.json")
    plan = ["plan", str(EXAMPLES / "cpu_tiny.yaml"), "--nodes", "1", "--gpus-per-node", "6",
            "--set", "distributed.expert_parallel_size=3", "--hf-config", config]  # fmt: skip
    assert main(plan) == 2
    out, err = capsys.readouterr()
    assert "1/3" not in out and "distributed.expert_parallel_size=3 does not divide the 4" in err


def test_nf4_blocks_are_checked_per_weight_one_a_line(tmp_path, capsys, configs, no_ray):
    lines = _all_three(tmp_path, capsys, "finetune_qlora", [
        f"model.pretrained={configs['odd']}", "model.export=null"])  # fmt: skip
    # 7 distinct linear weights per layer (the head is left in 16/32 bits); layers said once.
    assert len(lines) == 7, lines
    assert all(ln.startswith("model.lora.base_quantization='nf4' over 2 FSDP shard(s): ")
               for ln in lines)  # fmt: skip
    assert "model.layers.*.self_attn.q_proj.weight [48, 48]: shard [24, 48] holds 1152" in (
        "\n".join(lines)
    )
    assert all(len(ln) < 200 for ln in lines)


def test_the_loader_and_the_static_check_agree_on_nf4(configs):
    """The checkpoint the QLoRA example trains passes; at 3 shards it does not."""
    from ray_fsdp_backend.hf.layout_check import meta_model, nf4_errors

    model = meta_model(configs["llama_qlora"])
    assert nf4_errors(model, 2) == []
    assert nf4_errors(model, 3) and all("over 3 FSDP shard(s)" in e for e in nf4_errors(model, 3))


def test_tensor_parallel_heads_of_an_hf_model(tmp_path, capsys, configs, no_ray):
    lines = _all_three(tmp_path, capsys, "finetune_hf", [
        f"model.pretrained={configs['odd']}", "model.export=null",
        "distributed.tensor_parallel_size=2"])  # fmt: skip
    assert lines == [
        "distributed.tensor_parallel_size=2 does not divide num_attention_heads=3, "
        "num_key_value_heads=3 of LlamaForCausalLM: every split dimension and head count must "
        "be a multiple of the tp size"
    ]


def test_every_example_validates_after_a_previous_runs_export(tmp_path, capsys, configs):
    """Each example as written, its export already there (a second run):
    only the checkpoints the examples' comments create are stood in for."""
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_chat_data, save_tiny_pretrained
    from ray_fsdp_backend.preference.make_pairs import make_pairs, write_pairs
    from ray_fsdp_backend.rl.example_task import main as write_prompts

    stand_in = {
        "rfb-tiny-llama": configs["llama"],
        "rfb-tiny-llama-qlora": configs["llama_qlora"],
        "rfb-tiny-qwen3-moe": configs["qwen3_moe"],
        # sft_chat's records are rendered on the driver: a real tokenizer and records
        "rfb-tiny-chat": save_tiny_pretrained("llama", tmp_path / "chat", chat=True),
    }
    chat = save_tiny_chat_data(tmp_path / "chat" / "records")
    checked = 0
    for example in sorted(EXAMPLES.glob("*.yaml")):
        doc = load_yaml(example)
        model = doc.get("model") or {}
        if "pretrained" in model:
            model["pretrained"] = stand_in[Path(model["pretrained"]).name]
        data_format = (doc.get("data") or {}).get("format")
        if data_format == "chat":
            doc["data"] |= {"path": chat["train"], "eval_path": chat["eval"]}
        if data_format == "preference":  # the pairs the examples' headers write
            doc["data"]["path"] = write_pairs(str(tmp_path / "pairs.jsonl"), make_pairs(64))
        if data_format == "prompts":  # grpo's prompts, as its header writes them
            write_prompts([str(tmp_path / "prompts.jsonl")])
            doc["data"]["path"] = str(tmp_path / "prompts.jsonl")
        if model.get("export"):
            export = tmp_path / example.stem / "export"
            export.mkdir(parents=True)
            (export / "model.safetensors").write_bytes(b"the previous run's weights")
            model["export"] = str(export)
            checked += 1
        path = tmp_path / example.name
        path.write_text(yaml.safe_dump(doc))
        assert main(["validate", str(path)]) == 0, (example.name, capsys.readouterr().out)
    # dpo, finetune_hf, finetune_lora, finetune_qlora, moe_ep, pipeline_tiny, reward, sft_chat
    assert checked == 8


def test_storage_path_is_checked_before_ray(tmp_path, s3_server, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    assert storage_errors(str(tmp_path / "new" / "runs")) == []  # creatable
    [error] = storage_errors(str(tmp_path / "a-file" / "runs"))
    assert error.startswith(f"run.storage_path='{tmp_path}/a-file/runs': ") and "a file" in error
    doc = apply_overrides(load_yaml(EXAMPLES / "cpu_tiny.yaml"),
                          [f"run.storage_path={tmp_path / 'a-file'}"])  # fmt: skip
    assert any(e.startswith("run.storage_path=") for e in check_spec(doc))
    # An object store: the bucket must be there (moto on loopback).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    query = f"?endpoint_override={s3_server.endpoint}&scheme=http&region=us-east-1"
    [missing] = storage_errors(f"s3://no-such-bucket/runs{query}")
    assert "bucket 'no-such-bucket' not found" in missing and missing.startswith("run.storage_path")
    s3_server.filesystem().create_dir("runs-bucket")
    assert storage_errors(f"s3://runs-bucket/runs{query}") == []


def test_yaml_numbers_as_users_write_them(tmp_path):
    path = tmp_path / "c.yaml"
    text = (EXAMPLES / "cpu_tiny.yaml").read_text().replace("lr: ", "lr: 2e-3 #", 1)
    path.write_text(text)
    assert build_spec(load_yaml(path)).train.lr == 2e-3
    doc = apply_overrides(load_yaml(EXAMPLES / "cpu_tiny.yaml"), ["train.lr=5E-4"])
    assert build_spec(doc).train.lr == 5e-4


def test_a_gpu_config_on_a_cluster_without_gpus_names_the_keys():
    spec = build_spec(load_yaml(EXAMPLES / "ddp.yaml"))  # use_gpu true, 8 workers, {CPU 8, GPU 1}
    [error] = cluster_errors(spec.scaling, {"CPU": 65.0, "memory": 1e9})
    assert error.startswith("scaling.use_gpu=True with scaling.num_workers=8 x 1 GPU needs 8 GPU")
    assert "the Ray cluster has 0 (it has: CPU 65)" in error
    assert cluster_errors(spec.scaling, {"CPU": 64.0, "GPU": 8.0}) == []
    # Fewer GPUs than asked, and CPUs short as well: one line each.
    errors = cluster_errors(spec.scaling, {"CPU": 16.0, "GPU": 4.0})
    assert [e.split(" needs ")[1].split(",")[0] for e in errors] == [
        "64 CPU", "8 GPU"]  # fmt: skip
    auto = build_spec(apply_overrides(load_yaml(EXAMPLES / "cpu_tiny.yaml"),
                                      ["scaling.use_gpu=auto"]))  # fmt: skip
    assert cluster_errors(auto.scaling, {"CPU": 3.0}) == []


def test_torchao_is_imported_only_by_a_quantising_run(configs):
    """The driver (``ray-fsdp`` as a command) and a worker of a run without
    ``base_quantization`` build transformers models without importing
    torchao (13 console lines a process); a QLoRA worker still can."""
    import subprocess
    import sys

    script = f"""
import sys
from ray_fsdp_backend.cli.main import main
sys.argv = ["ray-fsdp", "validate", {str(EXAMPLES / "finetune_hf.yaml")!r},
            "--set", "model.pretrained={configs["llama"]}", "--set", "model.export=null"]
assert main() == 0
assert sys.modules.get("torchao") is None, "the driver imported torchao"
from ray_fsdp_backend.trainer.loop.train import quantizes
assert not quantizes({{"model": {{"lora": {{"r": 8}}}}}})
assert quantizes({{"model": {{"lora": {{"base_quantization": "nf4"}}}}}})
print("--- quantising", file=sys.stderr, flush=True)
del sys.modules["torchao"]  # a process that quantises imports it on use
from ray_fsdp_backend.ops.quantization import _packed_nf4_class
_packed_nf4_class()
assert sys.modules.get("torchao") is not None
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    before = out.stderr.split("--- quantising")[0]
    assert "Failed to load" not in before, before[-2000:]


def test_the_tiny_checkpoint_maker_prints_no_torchao_lines(tmp_path):
    """``python -m ray_fsdp_backend.models.tiny_pretrained`` (the examples'
    first command) quantises nothing, so torchao's load failures stay out."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "ray_fsdp_backend.models.tiny_pretrained"]
    out = subprocess.run([*command, str(tmp_path / "tiny"), "--chat"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to load" not in out.stderr and "torchao" not in out.stderr, out.stderr
