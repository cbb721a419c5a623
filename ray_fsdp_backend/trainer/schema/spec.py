"""The training YAML: load it, apply ``--set`` overrides, check every section.

A training config has these top-level sections::

    distributed:   FSDPConfig fields (ray_fsdp_backend.settings.config.FSDPSettings)
    model:         ModelConfig fields (ray_fsdp_backend.models.decoder)
    train:         TrainOptions fields (steps, batch sizes, lr, optimizer, ...)
    data:          DataOptions fields (corpus path or a Ray Data text dataset)
    scaling:       ScalingOptions fields (workers, GPUs, resources)
    run:           RunOptions fields (name, storage_path, max_failures)
    logging:       LoggingOptions fields (tensorboard, verbose)
    rollout:       RolloutOptions fields (train.objective: grpo; ray_fsdp_backend.trainer.schema.rl)
    reward:        module:function, or RewardOptions fields (train.objective: grpo)

:func:`check_spec` returns *every* problem as a list of messages (what
``ray-fsdp validate`` prints); :func:`build_spec` returns the typed
:class:`RunSpec` or raises ``ValueError`` with all of them. The sections'
dataclasses and key checks are in :mod:`~ray_fsdp_backend.trainer.schema.options`,
the rules spanning sections in :mod:`~ray_fsdp_backend.trainer.schema.rules`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_fsdp_backend.models.config import ModelConfig
from ray_fsdp_backend.settings.config import FSDPSettings, parse_yaml
from ray_fsdp_backend.trainer.schema.options import (
    DATA_FORMATS,
    DATA_SOURCES,
    OPTIMIZERS,
    SFT_FORMATS,
    DataOptions,
    LoggingOptions,
    RunOptions,
    ScalingOptions,
    TrainOptions,
    options_builder,
)
from ray_fsdp_backend.trainer.schema.pretrained import PretrainedModelConfig, build_model_section
from ray_fsdp_backend.trainer.schema.rl import (
    PROMPTS_FORMAT,
    RewardOptions,
    RolloutOptions,
    build_reward,
    build_rollout,
    normalise_reward,
    prompt_input_errors,
)
from ray_fsdp_backend.trainer.schema.rules import (
    cross_section_errors,
    data_errors,
    model_group,
    qlora_errors,
    tensor_parallel_errors,
)

__all__ = [
    "DATA_FORMATS",
    "DATA_SOURCES",
    "OPTIMIZERS",
    "SFT_FORMATS",
    "DataOptions",
    "LoggingOptions",
    "RunOptions",
    "RunSpec",
    "ScalingOptions",
    "TrainOptions",
    "apply_overrides",
    "build_spec",
    "check_spec",
    "data_errors",
    "load_spec",
    "load_yaml",
    "model_group",
    "qlora_errors",
    "tensor_parallel_errors",
]


@dataclass(frozen=True)
class RunSpec:
    """A checked training config, one typed object per section."""

    distributed: FSDPSettings
    """``rfb.FSDPConfig`` (Ray's ``TorchConfig``: ``TorchTrainer(torch_config=...)``)
    from :func:`build_spec`; the plain settings with ``torch_config=False``."""
    model: ModelConfig | PretrainedModelConfig
    train: TrainOptions
    data: DataOptions
    scaling: ScalingOptions
    run: RunOptions
    logging: LoggingOptions
    rollout: RolloutOptions = RolloutOptions()
    reward: RewardOptions = RewardOptions()
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    """The document after overrides: what the workers receive."""


# -- loading ---------------------------------------------------------------


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    with open(path) as f:
        doc = parse_yaml(f) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{os.fspath(path)}: top level must be a mapping of sections")
    return doc


def apply_overrides(doc: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``doc`` with each ``section.key=value`` set; values are YAML
    (``20``, ``true``, ``[a, b]``, ``null``)."""
    out = copy.deepcopy(normalise_reward(doc))  # reward: module:function is a section too
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise ValueError(f"--set {item!r}: expected section.key=value, e.g. train.steps=20")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = parse_yaml(text)
    return out


# -- checking --------------------------------------------------------------

_SECTIONS = (
    *("distributed", "model", "train", "data", "scaling", "run", "logging"),
    *("rollout", "reward"),
)  # = _BUILDERS


def check_spec(doc: Mapping[str, Any]) -> list[str]:
    """Every problem in a config document, one message each; empty when valid.

    Rules that span sections (``optimizer`` against ``use_dmuon``) are checked
    whenever the sections they involve are valid on their own.
    """
    return check_spec_report(doc)[0]


def check_spec_report(doc: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """:func:`check_spec`'s errors, and what the check counted in the data
    (an SFT run's records, rows and padding per file: ``validate`` prints them)."""
    doc = normalise_reward(doc)
    errors = [
        f"unknown section {key!r}; sections are {', '.join(_SECTIONS)}"
        for key in doc
        if key not in _SECTIONS
    ]
    if "distributed" not in doc:
        errors.append("no 'distributed:' section (FSDPConfig fields)")
    built = {}
    for name, (cls, build) in _BUILDERS.items():
        section = doc.get(name) or {}
        if not isinstance(section, Mapping):
            errors.append(f"section {name!r} must be a mapping, got {type(section).__name__}")
            continue
        section_errors = _section_errors(name, cls, build, section)
        errors += section_errors
        if not section_errors:
            built[name] = build(section)
    errors += cross_section_errors(built)
    data, counted = built.get("data"), []
    if not errors and data is not None and data.is_sft:  # reads records: once all else holds
        from ray_fsdp_backend.trainer.schema.sft import sft_input_check

        group = model_group(built.get("distributed"))
        found, counted = sft_input_check(
            data, built["model"], built["train"], built["scaling"], group
        )
        errors += found
    if not errors and data is not None and data.format == PROMPTS_FORMAT:
        errors += prompt_input_errors(data, built["model"], built["rollout"])
    return errors, counted


def build_spec(doc: Mapping[str, Any], *, torch_config: bool = True) -> RunSpec:
    """The typed spec for a document.

    ``distributed`` is an ``rfb.FSDPConfig``, which imports Ray; with
    ``torch_config=False`` it is the same fields as plain
    :class:`~ray_fsdp_backend.settings.config.FSDPSettings` (what ``plan`` reads:
    neither Ray nor torch is imported). The checks are the same either way.

    Raises:
        ValueError: listing every problem :func:`check_spec` finds.
    """
    errors = check_spec(doc)
    if errors:
        raise ValueError("invalid training config:\n  " + "\n  ".join(errors))
    return _build(doc, torch_config)


def load_spec(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunSpec:
    return build_spec(apply_overrides(load_yaml(path), overrides))


def _build(doc: Mapping[str, Any], torch_config: bool) -> RunSpec:
    doc = normalise_reward(doc)

    def section(name: str) -> Mapping[str, Any]:
        return doc.get(name) or {}

    builders = {name: build for name, (_, build) in _BUILDERS.items()}
    if torch_config:
        from ray_fsdp_backend.runtime.backend import FSDPConfig  # Ray's TorchConfig: imports Ray

        builders["distributed"] = FSDPConfig.from_dict
    sections = {name: build(section(name)) for name, build in builders.items()}
    return RunSpec(**sections, raw=copy.deepcopy(dict(doc)))


def _section_errors(
    name: str, cls: type, build: Callable[[Mapping[str, Any]], Any], values: Mapping[str, Any]
) -> list[str]:
    """Every problem in one section, each reported once.

    Unknown keys are reported one by one (with the builder's own message).
    Then the section is built; on an error, the keys the message names are
    dropped and it is built again, until it builds or a message names no key
    left. Known keys are never checked alone: ``n_heads: 3`` is only wrong
    next to ``dim: 128``.
    """
    known = {f.name for f in dataclasses.fields(cls)} | _EXTRA_KEYS.get(name, set())
    errors, remaining = [], {}
    for key, value in values.items():
        if key in known:
            remaining[key] = value
            continue
        try:
            build({key: value})
        except (ValueError, TypeError) as exc:
            errors.append(f"{name}: {exc}")
    while True:
        try:
            build(remaining)
            return errors
        except (ValueError, TypeError) as exc:
            errors.append(f"{name}: {exc}")
            named = [k for k in remaining if _names_key(str(exc), str(k))]
            if not named:
                return errors
            for key in named:
                del remaining[key]


_MODEL_KEYS = ("preset", "pretrained", "export", "export_format", "export_overwrite", "lora")
_EXTRA_KEYS = {"model": {*_MODEL_KEYS, "base_dtype"}}


def _names_key(message: str, key: str) -> bool:
    """Whether ``message`` mentions ``key`` as a whole word (``model.dim=``, ``'dim'``)."""
    return re.search(rf"(?<!\w){re.escape(key)}\b", message) is not None


_BUILDERS: dict[str, tuple[type, Callable[[Mapping[str, Any]], Any]]] = {
    "distributed": (FSDPSettings, FSDPSettings.from_dict),
    "model": (ModelConfig, build_model_section),
    "train": (TrainOptions, options_builder(TrainOptions, "train")),
    "data": (DataOptions, options_builder(DataOptions, "data")),
    "scaling": (ScalingOptions, options_builder(ScalingOptions, "scaling")),
    "run": (RunOptions, options_builder(RunOptions, "run")),
    "logging": (LoggingOptions, options_builder(LoggingOptions, "logging")),
    "rollout": (RolloutOptions, build_rollout),
    "reward": (RewardOptions, build_reward),
}
"""Each section's dataclass and the function that builds it from a mapping."""
