"""The training YAML: load it, apply ``--set`` overrides, check every section.

A training config has these top-level sections::

    distributed:   FSDPConfig fields (ray_fsdp_backend.config.FSDPSettings)
    model:         ModelConfig fields (ray_fsdp_backend.trainer.model)
    train:         TrainOptions fields (steps, batch sizes, lr, optimizer, ...)
    data:          DataOptions fields (corpus path or a Ray Data text dataset)
    scaling:       ScalingOptions fields (workers, GPUs, resources)
    run:           RunOptions fields (name, storage_path, max_failures)
    logging:       LoggingOptions fields (tensorboard, verbose)

:func:`check_spec` returns *every* problem as a list of messages (what
``ray-fsdp validate`` prints); :func:`build_spec` returns the typed
:class:`RunSpec` or raises ``ValueError`` with all of them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_fsdp_backend.config import FSDPSettings, parse_yaml, unknown_key_message
from ray_fsdp_backend.elastic import describe_group_sizes, elastic_world_sizes, worker_range
from ray_fsdp_backend.memory import DEFAULT_CHUNK_TOKENS
from ray_fsdp_backend.trainer.model_config import ModelConfig
from ray_fsdp_backend.trainer.preflight import storage_errors
from ray_fsdp_backend.trainer.pretrained import PretrainedModelConfig, build_model_section

OPTIMIZERS = ("adamw", "muon")
DATA_SOURCES = ("corpus", "ray_data")
DATA_FORMATS = ("text", "chat", "prompt_completion")
SFT_FORMATS = ("chat", "prompt_completion")
"""The formats ``rfb.sft_dataset`` reads (records of a JSONL / parquet dataset)."""


@dataclass(frozen=True)
class TrainOptions:
    """The ``train:`` section."""

    steps: int = 100
    """Optimizer steps."""
    micro_batch_size: int = 8
    """Sequences per rank per forward/backward; with ``global_batch_size`` the
    largest micro-batch allowed."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; all but the last run under ``no_sync``."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all ranks, whatever the worker count
    (elastic runs): each (re)start derives the micro-batch and ``grad_accum``
    from it and the data-parallel size (:mod:`ray_fsdp_backend.elastic`); it
    must be a multiple of the world size. None: ``micro_batch_size *
    grad_accum * workers``."""
    lr: float = 3e-3
    """Peak learning rate (after warmup; cosine decay to ``min_lr_ratio * lr``);
    with ``optimizer: muon`` the rate of the Muon matrices."""
    adamw_lr: float | None = None
    """With ``optimizer: muon``: AdamW's rate for embeddings and norms; None: ``lr``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (2-D weights only)."""
    max_grad_norm: float | None = 1.0
    """Global gradient-norm clip; 0 or null disables clipping (the norm is still
    reported). A step whose norm is not finite is skipped and logged."""
    seed: int = 0
    """Fixes initialisation and the data order."""
    optimizer: str = "adamw"
    """``adamw``, or ``muon`` (needs ``distributed.use_dmuon: true``)."""
    log_every: int = 10
    """Steps between logged metrics (progress line, ``metrics.jsonl``,
    TensorBoard); Ray gets a report only with a checkpoint and after the last
    step, so logging every step costs no waiting on Ray."""
    checkpoint_every: int = 0
    """Steps between checkpoints (model, optimizer, step, data position); 0: none."""
    checkpoint_async: bool = False
    """Write checkpoints in the background: the saving step waits only for a
    copy of the state in host memory (``ctx.save_checkpoint(async_save=True)``)."""
    eval_every: int = 0
    """Steps between evaluations of the held-out set (``data.eval_path`` or
    ``data.eval_fraction``); 0: only after the last step. Needs an eval set."""
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens per chunk of the cross-entropy, which then never holds the whole
    ``[tokens, vocab]`` logits (``rfb.linear_cross_entropy``; docs/parallelism.md);
    0: ``F.cross_entropy`` on the full fp32 logits."""


@dataclass(frozen=True)
class DataOptions:
    """The ``data:`` section."""

    format: str = "text"
    """``text``: plain text, the loss on every token (``source`` says how it
    is read). ``chat`` (a list of ``{role, content}`` messages per record) or
    ``prompt_completion`` (two text fields): JSONL / parquet records read by
    Ray Data on CPU workers, rendered with the checkpoint tokenizer's chat
    template and packed (``rfb.sft_dataset``); needs ``model.pretrained``."""
    source: str = "corpus"
    """``format: text`` only. ``corpus``: one text file read by every worker,
    sharded by rank in a resumable order. ``ray_data``: ``ray.data.read_text(path)``
    split by Ray Data across the data-parallel ranks (``rfb.MeshDataConfig``:
    the ranks of a tp / cp group read the same rows), for datasets larger than one file."""
    path: str | None = None
    """Text file (``corpus``), files/directory/URI (``ray_data``), or the
    JSONL / parquet file or directory (local, ``s3://``, ``gs://``) of a
    ``chat`` / ``prompt_completion`` dataset; None is the shipped corpus (text only)."""
    messages_field: str = "messages"
    """``format: chat``: the field holding each record's messages."""
    prompt_field: str = "prompt"
    """``format: prompt_completion``: the prompt's field."""
    completion_field: str = "completion"
    """``format: prompt_completion``: the completion's field."""
    train_on_prompt: bool = False
    """``chat`` / ``prompt_completion``: False puts the loss on the assistant
    turns (or the completion) only; True on every token."""
    packing: bool = False
    """Concatenate documents into ``model.seq_len`` rows, ``position_ids``
    restarting per document; attention never crosses documents. With
    ``format: text``: the corpus's lines, byte-level model and ``corpus``
    source; with ``chat`` / ``prompt_completion``: the records (False: one
    record a row, padded). Composes with Ulysses context parallelism, not ring."""
    eval_path: str | None = None
    """``chat`` / ``prompt_completion``: a held-out dataset in the same
    format; its token-mean loss is logged as ``eval_loss``."""
    eval_fraction: float | None = None
    """``chat`` / ``prompt_completion``: hold out this fraction (0 < f < 1)
    of ``path``'s rows instead of an ``eval_path`` (a seeded hash of each
    packed row picks them)."""

    @property
    def is_sft(self) -> bool:
        """Whether the data are records for ``rfb.sft_dataset`` (not plain text)."""
        return self.format in SFT_FORMATS

    @property
    def has_eval(self) -> bool:
        return self.eval_path is not None or self.eval_fraction is not None


@dataclass(frozen=True)
class ScalingOptions:
    """The ``scaling:`` section (becomes ``ray.train.ScalingConfig``)."""

    num_workers: int | list[int] = 2
    """Training worker processes: one per GPU on a GPU cluster. ``[min, max]``
    makes the run elastic: Ray starts as many as fit (at least ``min``),
    restarts smaller from the newest checkpoint when a node is lost and grows
    back when capacity returns."""
    elastic_resize_monitor_interval_s: float = 60.0
    """Elastic runs: seconds between Ray's checks for room to grow the group."""
    use_gpu: bool | str = "auto"
    """True, False, or ``auto``: use GPUs when the Ray cluster has any."""
    resources_per_worker: dict[str, float] | None = None
    """Ray resources for each worker, e.g. ``{CPU: 8, GPU: 1}``."""
    placement_strategy: str = "PACK"
    """Ray placement-group strategy: PACK fills a node before the next."""


@dataclass(frozen=True)
class RunOptions:
    """The ``run:`` section (becomes ``ray.train.RunConfig``)."""

    name: str | None = None
    """Run directory name; None: the config file's stem and a timestamp."""
    storage_path: str | None = None
    """Where metrics, plots and checkpoints go: a shared file system or a cloud
    URI (``s3://...``, ``gs://...``) on multi-node clusters; None: ``~/ray_results``."""
    max_failures: int = 0
    """Restarts from the latest checkpoint after a worker failure."""


@dataclass(frozen=True)
class LoggingOptions:
    """The ``logging:`` section (optional)."""

    tensorboard: str | None = None
    """Directory for TensorBoard event files (every metric as a scalar, written
    by rank 0); a relative path is taken from where ``ray-fsdp`` runs. None:
    no TensorBoard."""
    verbose: bool = False
    """Show everything on the console: Ray Train's per-report lines, Ray
    Data's progress bars, the library warnings the trainer quietens
    (``ray-fsdp train -v`` sets it; docs/monitoring.md)."""


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
    out = copy.deepcopy(dict(doc))
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

_SECTIONS = ("distributed", "model", "train", "data", "scaling", "run", "logging")  # = _BUILDERS


def check_spec(doc: Mapping[str, Any]) -> list[str]:
    """Every problem in a config document, one message each; empty when valid.

    Rules that span sections (``optimizer`` against ``use_dmuon``) are checked
    whenever the sections they involve are valid on their own.
    """
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
    errors += _cross_section_errors(built)
    data = built.get("data")
    if not errors and data is not None and data.is_sft:  # reads records: once all else holds
        from ray_fsdp_backend.trainer.sft_data import sft_input_errors

        errors += sft_input_errors(data, built["model"])
    return errors


def build_spec(doc: Mapping[str, Any], *, torch_config: bool = True) -> RunSpec:
    """The typed spec for a document.

    ``distributed`` is an ``rfb.FSDPConfig``, which imports Ray; with
    ``torch_config=False`` it is the same fields as plain
    :class:`~ray_fsdp_backend.config.FSDPSettings` (what ``plan`` reads:
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
    def section(name: str) -> Mapping[str, Any]:
        return doc.get(name) or {}

    builders = {name: build for name, (_, build) in _BUILDERS.items()}
    if torch_config:
        from ray_fsdp_backend.backend import FSDPConfig  # Ray's TorchConfig: imports Ray

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


# -- the option dataclasses -------------------------------------------------

_POSITIVE_INTS = {"steps", "micro_batch_size", "grad_accum", "log_every"}
_NON_NEGATIVE = {"warmup_steps", "checkpoint_every", "max_failures", "seed", "weight_decay"}
_NON_NEGATIVE |= {"eval_every"}
_NON_NEGATIVE_INTS = {"loss_chunk_tokens"}
_NON_NEGATIVE |= {"max_grad_norm", "min_lr_ratio"}
_CHOICES = {
    "optimizer": OPTIMIZERS,
    "source": DATA_SOURCES,
    "format": DATA_FORMATS,
    "use_gpu": (True, False, "auto"),
    "checkpoint_async": (True, False),
    "placement_strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "verbose": (True, False),
}
_FLOATS = {"lr", "min_lr_ratio", "weight_decay", "max_grad_norm"}
_OPTIONAL_POSITIVE = {"adamw_lr", "global_batch_size", "elastic_resize_monitor_interval_s"}
_OPTIONAL_STRS = {"path", "name", "storage_path", "tensorboard", "eval_path"}
_FIELD_NAMES = {"messages_field", "prompt_field", "completion_field"}
_BOOLS = {"train_on_prompt", "packing"}  # not in _CHOICES: 1 == True there


def _build_options(cls: type, section: str, values: Mapping[str, Any]) -> Any:
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in values if k not in known]
    if unknown:
        raise ValueError("; ".join(unknown_key_message(k, known, section) for k in unknown))
    for key, value in values.items():
        _check_option(key, value)
    return cls(**dict(values))


def _check_option(key: str, value: Any) -> None:
    if key == "max_grad_norm" and value is None:  # null, like 0: no clipping
        return
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in _POSITIVE_INTS and not (is_number and isinstance(value, int) and value > 0):
        raise ValueError(f"{key}={value!r} must be a positive int")
    if key in _NON_NEGATIVE_INTS and not (is_number and isinstance(value, int) and value >= 0):
        raise ValueError(f"{key}={value!r} must be a non-negative int (0: full logits)")
    if key in _FLOATS and not is_number:
        raise ValueError(f"{key}={value!r} must be a number")
    if key in _NON_NEGATIVE and not (is_number and value >= 0):
        raise ValueError(f"{key}={value!r} must be a non-negative number")
    if key == "lr" and value <= 0:
        raise ValueError(f"lr={value!r} must be positive")
    if key in _OPTIONAL_POSITIVE and value is not None and not (is_number and value > 0):
        raise ValueError(f"{key}={value!r} must be a positive number or null")
    if key == "global_batch_size" and value is not None and not isinstance(value, int):
        raise ValueError(f"global_batch_size={value!r} must be a positive int or null")
    if key == "num_workers":
        worker_range(value)
    if key in _CHOICES and value not in _CHOICES[key]:
        allowed = ", ".join(str(c).lower() if isinstance(c, bool) else c for c in _CHOICES[key])
        raise ValueError(f"{key}={value!r} is not one of {allowed}")
    if key in _OPTIONAL_STRS and value is not None and not isinstance(value, str):
        raise ValueError(f"{key}={value!r} must be a string or null")
    if key in _BOOLS and not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be true or false")
    if key in _FIELD_NAMES and not (isinstance(value, str) and value):
        raise ValueError(f"{key}={value!r} must be a record field's name")
    if key == "eval_every" and not isinstance(value, int):
        raise ValueError(f"eval_every={value!r} must be a non-negative int")
    if key == "eval_fraction" and value is not None and not (is_number and 0 < value < 1):
        raise ValueError(f"eval_fraction={value!r} must be a number between 0 and 1 or null")
    if key == "resources_per_worker" and value is not None:
        if not isinstance(value, Mapping) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
            for v in value.values()
        ):
            raise ValueError(f"resources_per_worker={value!r} must map resource names to numbers")


def _options_builder(cls: type, section: str) -> Callable[[Mapping[str, Any]], Any]:
    return lambda values: _build_options(cls, section, values)


_BUILDERS: dict[str, tuple[type, Callable[[Mapping[str, Any]], Any]]] = {
    "distributed": (FSDPSettings, FSDPSettings.from_dict),
    "model": (ModelConfig, build_model_section),
    "train": (TrainOptions, _options_builder(TrainOptions, "train")),
    "data": (DataOptions, _options_builder(DataOptions, "data")),
    "scaling": (ScalingOptions, _options_builder(ScalingOptions, "scaling")),
    "run": (RunOptions, _options_builder(RunOptions, "run")),
    "logging": (LoggingOptions, _options_builder(LoggingOptions, "logging")),
}
"""Each section's dataclass and the function that builds it from a mapping."""


def _cross_section_errors(built: Mapping[str, Any]) -> list[str]:
    """Rules spanning sections, each checked when its sections built."""
    errors = []
    train, dist, model, data = (built.get(k) for k in ("train", "distributed", "model", "data"))
    if train is not None and dist is not None and (train.optimizer == "muon") != dist.use_dmuon:
        errors.append(
            f"train.optimizer={train.optimizer!r} and distributed.use_dmuon="
            f"{dist.use_dmuon} disagree: Muon runs as DMuon on FSDP shards, "
            "so use optimizer muon with use_dmuon true, or adamw with use_dmuon false"
        )
    group = model_group(dist)
    errors += _group_errors(dist, built.get("scaling")) or _batch_errors(
        train, built.get("scaling"), group
    )
    errors += _context_parallel_errors(dist, model, data, built.get("scaling"))
    if dist is not None and dist.pipeline_parallel_size > 1:  # the split imports torch
        from ray_fsdp_backend.trainer.pipeline import pipeline_errors

        errors += pipeline_errors(dist, model, train, data)
    errors += tensor_parallel_errors(dist, model)
    errors += qlora_errors(dist, model)
    if isinstance(model, ModelConfig) and model.vocab_size != 256:
        errors.append(f"model.vocab_size={model.vocab_size} must be 256 (byte tokens)")
    if isinstance(model, PretrainedModelConfig):
        # the checkpoint exists, LoRA targets match, its shapes fit the layout: before Ray starts
        found = model.check()
        errors += found or _pretrained_layout_errors(model, dist, built.get("scaling"))
    if built.get("run") is not None:
        errors += storage_errors(built["run"].storage_path)
    if data is not None:
        errors += data_errors(data, model, train)
    return errors


def data_errors(data: DataOptions, model, train: TrainOptions | None) -> list[str]:
    """The ``data:`` section against the model and ``train.eval_every``
    (keys only; the records themselves are read by ``sft_input_errors``)."""
    errors = []
    pretrained = isinstance(model, PretrainedModelConfig)
    if data.is_sft:
        if model is not None and not pretrained:
            errors.append(
                f"data.format={data.format!r} needs model.pretrained: records are rendered "
                "with its tokenizer's chat template (the byte-level model has none)"
            )
        if data.path is None:
            errors.append(f"data.format={data.format!r} needs data.path (JSONL or parquet)")
        for key in ("path", "eval_path"):
            path = getattr(data, key)
            if path is not None and "://" not in path and not os.path.exists(path):
                errors.append(f"data.{key}={path!r} is not a file or directory")
        if data.eval_path is not None and data.eval_fraction is not None:
            errors.append(
                f"data.eval_path={data.eval_path!r} and data.eval_fraction={data.eval_fraction}: "
                "choose one held-out set"
            )
    elif data.has_eval:
        key = "eval_path" if data.eval_path is not None else "eval_fraction"
        errors.append(
            f"data.{key} with data.format='text': evaluation runs on chat / "
            "prompt_completion records"
        )
    if train is not None and train.eval_every and not data.has_eval:
        errors.append(
            f"train.eval_every={train.eval_every} needs a held-out set: data.eval_path or "
            "data.eval_fraction"
        )
    return errors + ([] if data.is_sft else _text_errors(data, pretrained))


def _text_errors(data: DataOptions, pretrained: bool) -> list[str]:
    """``format: text``: its source and path."""
    errors = []
    if pretrained and data.source != "corpus":
        errors.append(
            "model.pretrained with data.format='text' trains on data.source='corpus' (its "
            "tokenizer's ids); for JSONL / parquet records use data.format chat or "
            "prompt_completion"
        )
    if data.source == "ray_data" and data.path is None:
        errors.append("data.source='ray_data' needs data.path (files or a directory of text)")
    if data.source == "corpus" and data.path is not None:
        if "://" not in data.path and not os.path.isfile(data.path):
            errors.append(f"data.path={data.path!r} is not a file")
    return errors


def _pretrained_layout_errors(model, dist, scaling) -> list[str]:
    """The checkpoint's shapes against the layout at the smallest and largest
    worker count, on one node (``plan`` checks its own nodes)."""
    if dist is None or scaling is None:
        return []
    from ray_fsdp_backend.hf.layout_check import pretrained_layout_errors

    low, high = worker_range(scaling.num_workers)
    return pretrained_layout_errors(model, dist, [[n] for n in sorted({low, high})])


def _context_parallel_errors(dist, model, data, scaling) -> list[str]:
    """Layouts the cp ranks cannot run, caught before any worker starts."""
    if dist is None or model is None:
        return []
    cp, ring = dist.context_parallel_size, dist.context_parallel_backend == "ring"
    errors = []
    if data is not None and data.packing:
        if ring and cp > 1:
            errors.append(
                "data.packing with distributed.context_parallel_backend=ring: torch's ring "
                "attention takes no mask, so packed rows would attend across documents; "
                "use ulysses"
            )
        if not data.is_sft and (not isinstance(model, ModelConfig) or data.source != "corpus"):
            errors.append(
                "data.packing with data.format='text' needs the byte-level model and "
                "data.source='corpus'; a pretrained model packs chat / prompt_completion records"
            )
    if cp == 1:
        return errors
    parts = 2 * cp if ring else cp
    if model.seq_len % parts:
        rule = "2 x context_parallel_size" if ring else "context_parallel_size"
        errors.append(f"model.seq_len={model.seq_len} is not divisible by {rule} = {parts}")
    if isinstance(model, ModelConfig):
        device = "cuda" if scaling is None or scaling.use_gpu is not False else "cpu"
        try:
            dist.resolve_cp_backend(model.n_heads, device)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def qlora_errors(dist, model) -> list[str]:
    """Layouts an NF4 base (``model.lora.base_quantization``) cannot run:
    NF4 shards live in FSDP2's all-gather, so no DDP, DMuon or tensor parallel."""
    lora = getattr(model, "lora", None)
    if dist is None or lora is None or lora.base_quantization is None:
        return []
    key = f"model.lora.base_quantization={lora.base_quantization!r}"
    rules = [
        (not dist.use_fsdp, "distributed.use_fsdp=false (DDP would hold the whole base)"),
        (dist.use_dmuon, "distributed.use_dmuon=true (DMuon's team all-gathers are not NF4's)"),
        (
            dist.tensor_parallel_size > 1,
            f"distributed.tensor_parallel_size={dist.tensor_parallel_size} (NF4 shards by rows "
            "over FSDP only)",
        ),
    ]
    return [f"{key} with {what}: QLoRA runs on FSDP2 / HSDP" for bad, what in rules if bad]


def tensor_parallel_errors(dist, model) -> list[str]:
    """Model shapes the tp size does not divide (the byte-level decoder's are
    known here; a pretrained model's are checked by ``ctx.wrap``), and LoRA
    adapters, which the tensor-parallel plan does not split."""
    if dist is None or dist.tensor_parallel_size == 1:
        return []
    tp, errors = dist.tensor_parallel_size, []
    if isinstance(model, ModelConfig):
        sizes = dict(
            n_heads=model.n_heads,
            n_kv_heads=model.kv_heads,
            ffn_hidden=model.hidden,
            vocab_size=model.vocab_size,
        )
        bad = [f"model.{k}={v}" for k, v in sizes.items() if v % tp]
        if bad:
            errors.append(
                f"distributed.tensor_parallel_size={tp} does not divide {', '.join(bad)}: "
                "every split dimension and head count must be a multiple of the tp size"
            )
    if isinstance(model, PretrainedModelConfig) and model.lora is not None:
        errors.append(
            f"model.lora with distributed.tensor_parallel_size={tp}: the tensor-parallel plan "
            "does not split LoRA adapters; train LoRA with tensor_parallel_size 1 (FSDP2 "
            "shards the frozen base and the adapters over every rank)"
        )
    return errors


def _batch_errors(
    train: TrainOptions | None, scaling: ScalingOptions | None, group: int = 1
) -> list[str]:
    """A global batch that no allowed worker count can split (over its
    data-parallel size: ``group`` ranks per tp x cp group), or that conflicts
    with ``grad_accum`` (derived when the global batch is set)."""
    if train is None or train.global_batch_size is None:
        return []
    errors = []
    if train.grad_accum != 1:
        errors.append(
            f"train.grad_accum={train.grad_accum} with train.global_batch_size="
            f"{train.global_batch_size}: grad_accum is derived from the global batch; remove it"
        )
    if scaling is not None:
        low, high = worker_range(scaling.num_workers)
        fits, _ = elastic_world_sizes(train.global_batch_size, low, high, group)
        if not fits:
            per_group = f" divided by its tp x cp group of {group}" if group > 1 else ""
            errors.append(
                f"train.global_batch_size={train.global_batch_size} is not a multiple of any "
                f"worker count in scaling.num_workers={scaling.num_workers}{per_group}"
            )
    return errors


def _group_errors(dist, scaling: ScalingOptions | None) -> list[str]:
    """A worker range with no count that holds whole tp x cp groups."""
    if dist is None or scaling is None:
        return []
    tp, cp = dist.tensor_parallel_size, dist.context_parallel_size
    sizes = [f"tensor_parallel_size={tp}"] * (tp > 1) + [f"context_parallel_size={cp}"] * (cp > 1)
    label = "distributed." + " x ".join(sizes) if sizes else None
    message = describe_group_sizes(*worker_range(scaling.num_workers), model_group(dist), label)
    return [message] if message else []


def model_group(dist) -> int:
    """Ranks of one model-parallel (tp x cp x pp) group; 1 without the section."""
    if dist is None:
        return 1
    return dist.tensor_parallel_size * dist.context_parallel_size * dist.pipeline_parallel_size
