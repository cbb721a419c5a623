"""One static check for ``validate``, ``plan`` and ``train``: what ``train``
would refuse, ``validate`` names first, and nothing starts Ray.

Each broken config is run through all three commands; each must exit
non-zero naming the key, and ``ray.init`` is never called.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ray_fsdp_backend.cli import main
from ray_fsdp_backend.hf.check import check_pretrained
from ray_fsdp_backend.trainer.spec import apply_overrides, load_yaml

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
