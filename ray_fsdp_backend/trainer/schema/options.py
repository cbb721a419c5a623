"""The ``train:``, ``data:``, ``scaling:``, ``run:`` and ``logging:``
sections of the training YAML: their dataclasses (every key documented) and
the check of each key's value, which names the key, the value and the rule.
:mod:`ray_fsdp_backend.trainer.schema.spec` builds and checks the whole document.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ray_fsdp_backend.planning.elastic import worker_range
from ray_fsdp_backend.planning.memory import DEFAULT_CHUNK_TOKENS
from ray_fsdp_backend.settings.config import unknown_key_message
from ray_fsdp_backend.settings.policy import PolicyOptions
from ray_fsdp_backend.trainer.schema.preference import OBJECTIVES, DPOOptions

OPTIMIZERS = ("adamw", "muon")
DATA_SOURCES = ("corpus", "ray_data")
DATA_FORMATS = (
    *("text", "chat", "prompt_completion", "sharegpt", "alpaca", "preference"),
    "prompts",
)
SFT_FORMATS = ("chat", "prompt_completion", "sharegpt", "alpaca", "preference")
"""The formats of records in a JSONL / parquet dataset, checked on the driver:
``rfb.sft_dataset`` reads them, ``rfb.preference_dataset`` reads ``preference``."""


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
    from it and the data-parallel size (:mod:`ray_fsdp_backend.planning.elastic`); it
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
    objective: str = "sft"
    """``sft``: next-token cross-entropy. ``dpo`` (``train.dpo``) or
    ``reward`` (a Bradley-Terry reward model): preference pairs of
    ``data.format: preference`` (docs/preference.md)."""
    dpo: DPOOptions = DPOOptions()
    """``objective: dpo``: the loss type, ``beta``, the reference model
    (:class:`~ray_fsdp_backend.trainer.schema.preference.DPOOptions`)."""
    grpo: PolicyOptions = PolicyOptions()
    """``objective: grpo``: the group size, prompts per step, clip, KL and
    normalisation of the policy loss (:class:`~ray_fsdp_backend.settings.policy.PolicyOptions`;
    the ``rollout:`` and ``reward:`` sections, docs/rl.md)."""


@dataclass(frozen=True)
class DataOptions:
    """The ``data:`` section."""

    format: str = "text"
    """``text``: plain text, the loss on every token (``source`` says how it
    is read). ``chat`` (a list of ``{role, content}`` messages per record) or
    ``prompt_completion`` (two text fields), ``sharegpt`` (``conversations``
    of ``{from, value}``) or ``alpaca`` (``instruction``, ``input``,
    ``output``): JSONL / parquet records, every one checked on the driver,
    read by Ray Data on CPU workers, rendered with the checkpoint tokenizer's
    chat template and packed (``rfb.sft_dataset``); needs ``model.pretrained``."""
    source: str = "corpus"
    """``format: text`` only. ``corpus``: one text file read by every worker,
    sharded by rank in a resumable order. ``ray_data``: ``ray.data.read_text(path)``
    split by Ray Data across the data-parallel ranks (``rfb.MeshDataConfig``:
    the ranks of a tp / cp group read the same rows), for datasets larger than one file."""
    path: str | None = None
    """Text file (``corpus``), files/directory/URI (``ray_data``), or the
    JSONL / parquet file or directory (local, ``s3://``, ``gs://``) of a
    ``chat`` / ``prompt_completion`` dataset; None is the shipped corpus (text only)."""
    messages_field: str | None = None
    """``format: chat`` / ``sharegpt``: the field holding each record's
    messages; null: ``messages`` (``conversations`` under ``sharegpt``)."""
    tools_field: str = "tools"
    """``chat`` / ``sharegpt``: the field holding a record's tool schemas,
    passed to the chat template as ``tools``."""
    roles: dict[str, str] | None = None
    """The dataset's role names to the template's (``{human: user, gpt:
    assistant}``); a role that is then none of system, developer, user,
    assistant, tool, ipython is refused, naming its record."""
    prompt_field: str = "prompt"
    """``format: prompt_completion``: the prompt's field."""
    completion_field: str = "completion"
    """``format: prompt_completion``: the completion's field."""
    chosen_field: str = "chosen"
    """``format: preference``: the preferred response's field (text or messages)."""
    rejected_field: str = "rejected"
    """``format: preference``: the dispreferred response's field. A preference
    record is ``{prompt, chosen, rejected}`` (``prompt_field``; without it
    the prompt is the responses' shared prefix), each text or chat messages
    (docs/preference-rows.md)."""
    train_on_prompt: bool = False
    """``chat`` / ``prompt_completion``: False puts the loss on the assistant
    turns (or the completion) only; True on every token."""
    packing: bool = False
    """Concatenate documents into ``model.seq_len`` rows, ``position_ids``
    restarting per document; attention never crosses documents. With
    ``format: text``: the corpus's lines, byte-level model and ``corpus``
    source; with records: their documents (one a record, or one per turn its
    template renders apart; False: one document a row, padded). Composes with
    Ulysses context parallelism, not ring."""
    chat_template: str | None = None
    """``chat`` / ``sharegpt`` / ``alpaca`` / ``prompt_completion``: a Jinja
    chat template, or the path of a file holding one (relative to where
    ``ray-fsdp`` runs), used instead of the checkpoint tokenizer's; None: the
    tokenizer's. The families whose template needs it get their training
    patch either way (docs/sft-rows.md)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Keyword arguments of every chat-template call, e.g. ``{enable_thinking:
    false}`` for Qwen3 (the empty reasoning block then sits in the prompt)."""
    eval_path: str | None = None
    """``chat`` / ``prompt_completion``: a held-out dataset in the same
    format; its token-mean loss is logged as ``eval_loss``."""
    eval_fraction: float | None = None
    """``chat`` / ``prompt_completion``: hold out this fraction (0 < f < 1)
    of ``path``'s records instead of an ``eval_path``: a hash of each
    record's text as in the file, seeded by ``train.seed``, before rendering
    (the same records across epochs, restarts, template changes and worker
    counts)."""

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
    "objective": OBJECTIVES,
}
_FLOATS = {"lr", "min_lr_ratio", "weight_decay", "max_grad_norm"}
_OPTIONAL_POSITIVE = {"adamw_lr", "global_batch_size", "elastic_resize_monitor_interval_s"}
_OPTIONAL_STRS = {"path", "name", "storage_path", "tensorboard", "eval_path"}
_FIELD_NAMES = {"prompt_field", "completion_field", "tools_field"}
_FIELD_NAMES |= {"chosen_field", "rejected_field"}
_BOOLS = {"train_on_prompt", "packing"}  # not in _CHOICES: 1 == True there


def _build_options(cls: type, section: str, values: Mapping[str, Any]) -> Any:
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in values if k not in known]
    if unknown:
        raise ValueError("; ".join(unknown_key_message(k, known, section) for k in unknown))
    for key, value in values.items():
        _check_option(key, value)
    values = dict(values)
    if "dpo" in values:  # a nested section: its own checks name dpo.<key>
        values["dpo"] = DPOOptions.from_dict(values["dpo"])
    if "grpo" in values:
        values["grpo"] = PolicyOptions.from_dict(values["grpo"], "grpo")
    return cls(**values)


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
    if key == "messages_field" and value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"messages_field={value!r} must be a record field's name or null")
    if key == "roles" and value is not None and not _is_role_map(value):
        raise ValueError(f"roles={value!r} must map the dataset's role names to role names")
    if key == "eval_every" and not isinstance(value, int):
        raise ValueError(f"eval_every={value!r} must be a non-negative int")
    if key == "chat_template" and value is not None:
        _check_chat_template(value)
    if key == "chat_template_kwargs" and value is not None:
        if not (isinstance(value, Mapping) and all(isinstance(k, str) for k in value)):
            raise ValueError(
                f"chat_template_kwargs={value!r} must map names to values "
                "(the chat template's keyword arguments, e.g. {enable_thinking: false})"
            )
    if key == "eval_fraction" and value is not None and not (is_number and 0 < value < 1):
        raise ValueError(f"eval_fraction={value!r} must be a number between 0 and 1 or null")
    if key == "resources_per_worker" and value is not None:
        if not isinstance(value, Mapping) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
            for v in value.values()
        ):
            raise ValueError(f"resources_per_worker={value!r} must map resource names to numbers")


def _is_role_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _check_chat_template(value: Any) -> None:
    """A template string (holds ``{{`` or ``{%``) or a file that exists."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"chat_template={value!r} must be a Jinja template or a file path")
    if "{{" not in value and "{%" not in value and not os.path.isfile(value):
        raise ValueError(
            f"chat_template={value!r} is neither a Jinja template (no '{{{{' or '{{%') "
            "nor a file that exists (a relative path is taken from where ray-fsdp runs)"
        )


def options_builder(cls: type, section: str) -> Callable[[Mapping[str, Any]], Any]:
    return lambda values: _build_options(cls, section, values)
