"""``train.objective`` and ``train.dpo`` in the training YAML, without Ray:
every field's refusal names the field, the value and the rule; the rules
spanning sections (preference data, the reference, LoRA, pipeline
parallelism) are found by ``check_spec`` (what ``validate`` / ``plan`` run
before Ray starts)."""

from __future__ import annotations

import pytest

from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.trainer.schema.options import DataOptions, TrainOptions
from ray_fsdp_backend.trainer.schema.preference import (
    DPOOptions,
    Reference,
    preference_errors,
)
from ray_fsdp_backend.trainer.schema.spec import check_spec


def _errors(train=None, distributed=None) -> list[str]:
    return check_spec({"distributed": distributed or {}, "train": train or {}})


@pytest.mark.parametrize(
    ("train", "words"),
    [
        ({"objective": "ppo"}, "objective='ppo' is not one of sft, dpo, reward"),
        ({"dpo": {"loss_type": "sigmod"}}, "dpo.loss_type='sigmod' is not one of sigmoid, ipo"),
        ({"dpo": {"beta": 0}}, "dpo.beta=0 must be positive"),
        ({"dpo": {"beta": "high"}}, "dpo.beta='high' must be a number"),
        ({"dpo": {"label_smoothing": 0.5}}, "dpo.label_smoothing=0.5 must be a number in [0, 0.5)"),
        ({"dpo": {"simpo_gamma": -1}}, "dpo.simpo_gamma=-1 must be a non-negative number"),
        ({"dpo": {"reference": "copy"}}, "dpo.reference='copy' is not one of adapters, precompute"),
        ({"dpo": {"betta": 1}}, "unknown train.dpo config key 'betta'; did you mean 'beta'?"),
        ({"dpo": [1]}, "dpo=[1] must be a mapping"),
        (
            {"dpo": {"label_smoothing": 0.1}},
            "dpo.label_smoothing=0.1 with dpo.loss_type='sigmoid': only robust and simpo",
        ),
        (
            {"dpo": {"loss_type": "simpo", "reference": "frozen"}},
            "dpo.reference='frozen' with dpo.loss_type='simpo': simpo, orpo use no reference",
        ),
    ],
)
def test_bad_values_name_the_field_and_value(train, words):
    errors = _errors(train)
    assert any(words in e for e in errors), errors


def test_every_bad_dpo_field_is_reported_at_once():
    errors = _errors({"dpo": {"loss_type": "x", "beta": -1}})
    assert any("dpo.loss_type='x'" in e and "dpo.beta=-1" in e for e in errors), errors


def test_dpo_needs_preference_data_and_preference_data_a_preference_objective():
    errors = _errors({"objective": "dpo"})
    assert any("train.objective='dpo' needs data.format='preference'" in e for e in errors)
    data = DataOptions(format="preference", path="/pairs.jsonl")
    errors = preference_errors(TrainOptions(), data, None, None)
    assert errors == [
        "data.format='preference' with train.objective='sft': preference pairs train a "
        "preference objective; set train.objective to dpo or reward"
    ]
    assert preference_errors(TrainOptions(objective="dpo"), data, None, None) == []
    assert preference_errors(TrainOptions(objective="reward"), data, None, None) == []


def test_adapters_reference_needs_lora():
    train = {"objective": "dpo", "dpo": {"reference": "adapters"}}
    errors = _errors(train)
    assert any("train.dpo.reference='adapters' needs model.lora" in e for e in errors), errors


@pytest.mark.parametrize("objective", ["dpo", "reward"])
def test_pipeline_parallelism_is_refused_by_name(objective):
    data = DataOptions(format="preference", path="/pairs.jsonl")
    train = TrainOptions(objective=objective)
    dist = FSDPSettings(use_fsdp=True, pipeline_parallel_size=2)
    (error,) = preference_errors(train, data, None, dist)
    assert f"train.objective='{objective}' with distributed.pipeline_parallel_size=2" in error
    assert "a pair's chosen and rejected documents must share one micro-batch" in error
    assert preference_errors(TrainOptions(), DataOptions(), None, dist) == []


def test_the_reference_defaults_to_adapters_with_lora_else_precompute():
    assert DPOOptions().resolve_reference(lora=True) is Reference.ADAPTERS
    assert DPOOptions().resolve_reference(lora=False) is Reference.PRECOMPUTE
    assert DPOOptions(reference="frozen").resolve_reference(lora=True) is Reference.FROZEN
    assert DPOOptions(loss_type="orpo").resolve_reference(lora=True) is None


def test_a_good_section_builds():
    assert _errors({"objective": "sft", "dpo": {"loss_type": "ipo", "beta": 0.5}}) == []
