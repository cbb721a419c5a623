"""Every static check of :class:`ray_fsdp_backend.settings.config.FSDPSettings`.

The values each string field allows, the type each field must have, and the
rules between fields (what needs ``use_fsdp``, which parallelisms compose).
Each check raises ``ValueError`` naming the field, the value and the rule;
``FSDPSettings.__post_init__`` runs them all when the settings are built.
Like the config, this module imports nothing of the package but the pure
pipeline schedule rules (:mod:`.pipeline_schedules`), and nothing from Ray.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
from collections.abc import Mapping
from typing import Any

from ray_fsdp_backend.settings.pipeline_schedules import PIPELINE_SCHEDULES, schedule_errors


class ShardingStrategy(str, enum.Enum):
    """The seed's ``fsdp_sharding_strategy`` values, resolved once here."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    HYBRID_SHARD = "hybrid_shard"
    HYBRID_SHARD_ZERO2 = "_hybrid_shard_zero2"

    @property
    def is_hybrid(self) -> bool:
        """Whether the mesh is 2-D: replicate across nodes, shard inside one."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-2 modes keep parameters unsharded between forward and backward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


# Spellings accepted for a strategy, besides its canonical value.
_STRATEGY_ALIASES = {"hybrid_shard_zero2": ShardingStrategy.HYBRID_SHARD_ZERO2}
_REDUCE_DTYPES = ("bf16", "fp32")
_INIT_METHODS = ("env", "tcp")
UNEVEN_NODE_POLICIES = ("error", "split_nodes", "full_shard")
"""``hsdp_uneven_nodes`` values (used by :mod:`ray_fsdp_backend.planning.topology`)."""
_BACKENDS = ("nccl", "gloo", "cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl")


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "backend": (str, type(None)),
    "init_method": (str,),
    "timeout_s": (int,),
    "storage_retry_s": (int, float, type(None)),
    "use_fsdp": (bool,),
    "fsdp_sharding_strategy": (str,),
    "fsdp_hsdp_replicate_size": (int, type(None)),
    "hsdp_uneven_nodes": (str,),
    "fsdp_hsdp_shard_across_nodes": (bool,),
    "fsdp_cpu_offload": (bool,),
    "use_mixed_precision": (bool,),
    "bf16": (bool,),
    "fsdp_reduce_dtype": (str,),
    "fsdp_accumulate_unsharded": (bool,),
    "use_gradient_checkpointing": (bool,),
    "find_unused_parameters": (bool,),
    "broadcast_buffers": (bool,),
    "bucket_cap_mb": (int, float),
    "tensor_parallel_size": (int,),
    "sequence_parallel": (bool, type(None)),
    "context_parallel_size": (int,),
    "context_parallel_backend": (str,),
    "expert_parallel_size": (int,),
    "loss_parallel": (bool,),
    "use_dmuon": (bool,),
    "fsdp_block_classes": (tuple,),
    "compile": (bool, str),
    "peak_tflops": (int, float, type(None)),
    "nccl_env": (dict,),
    "pipeline_parallel_size": (int,),
    "pipeline_schedule": (str,),
    "pipeline_microbatches": (int, type(None)),
    "pipeline_virtual_stages": (int,),
    "pipeline_split": (str, tuple),
}


def _type_names(types: tuple[type, ...]) -> str:
    # A tuple field (fsdp_block_classes, pipeline_split) is a list in YAML.
    names = {type(None): "None", tuple: "list"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int subclass: `timeout_s: true` is a typo, not 1 second.
    is_bool_for_number = isinstance(value, bool) and bool not in types
    if is_bool_for_number or not isinstance(value, types):
        raise ValueError(
            f"{name}={value!r} has type {type(value).__name__}; expected {_type_names(types)}"
        )


def _check_one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}")


def check_str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}={value!r} must be a list of class names")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{name}={value!r}: every entry must be a non-empty string")
    return list(value)


def resolve_strategy(value: Any) -> ShardingStrategy:
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, str):
        if value in _STRATEGY_ALIASES:
            return _STRATEGY_ALIASES[value]
        try:
            return ShardingStrategy(value)
        except ValueError:
            pass
    allowed = ", ".join(s.value for s in ShardingStrategy)
    raise ValueError(f"fsdp_sharding_strategy={value!r} is not one of {allowed}")


# ``cfg`` below is the ``FSDPSettings`` being built (typed Any: config.py
# imports this module, and the package's imports form a tree).


def check_settings(cfg: Any) -> None:
    """Every field's type, then its value and the rules between fields, in
    that order (the first broken rule is the one reported).

    Raises:
        ValueError: naming the field, the value and the rule.
    """
    for f in dataclasses.fields(cfg):
        check_type(f.name, getattr(cfg, f.name), _FIELD_TYPES[f.name])
    _check_choices(cfg)
    _check_numbers(cfg)
    _check_precision_and_sharding(cfg)
    _check_tensor_parallel(cfg)
    _check_context_parallel(cfg)
    _check_expert_parallel(cfg)
    _check_pipeline_parallel(cfg)
    _check_nccl_env(cfg)


def _check_choices(cfg: Any) -> None:
    if cfg.backend is not None:
        _check_one_of("backend", cfg.backend, _BACKENDS)
    _check_one_of("init_method", cfg.init_method, _INIT_METHODS)
    _check_one_of("fsdp_reduce_dtype", cfg.fsdp_reduce_dtype, _REDUCE_DTYPES)
    _check_one_of("hsdp_uneven_nodes", cfg.hsdp_uneven_nodes, UNEVEN_NODE_POLICIES)
    if isinstance(cfg.compile, str):
        _check_one_of("compile", cfg.compile, ("auto", True, False))


def _check_numbers(cfg: Any) -> None:
    if cfg.timeout_s <= 0:
        raise ValueError(f"timeout_s={cfg.timeout_s!r} must be a positive number of seconds")
    if cfg.storage_retry_s is not None and not 0 <= cfg.storage_retry_s < cfg.timeout_s:
        raise ValueError(
            f"storage_retry_s={cfg.storage_retry_s!r} must be at least 0 and below "
            f"timeout_s={cfg.timeout_s!r}: the other ranks wait for a retrying one in a "
            "collective, which fails after timeout_s"
        )
    if cfg.bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb={cfg.bucket_cap_mb!r} must be positive")
    if cfg.fsdp_hsdp_replicate_size is not None:
        if cfg.fsdp_hsdp_replicate_size <= 0:
            raise ValueError(
                f"fsdp_hsdp_replicate_size={cfg.fsdp_hsdp_replicate_size!r} must be a positive int"
            )
        if not (cfg.use_fsdp and cfg.sharding_strategy.is_hybrid):
            raise ValueError(
                f"fsdp_hsdp_replicate_size={cfg.fsdp_hsdp_replicate_size!r} needs "
                "use_fsdp=true and fsdp_sharding_strategy hybrid_shard or _hybrid_shard_zero2 "
                f"(got use_fsdp={cfg.use_fsdp}, "
                f"fsdp_sharding_strategy={cfg.fsdp_sharding_strategy!r})"
            )
    if cfg.peak_tflops is not None and cfg.peak_tflops <= 0:
        raise ValueError(f"peak_tflops={cfg.peak_tflops!r} must be positive or null")


def _check_precision_and_sharding(cfg: Any) -> None:
    if cfg.use_mixed_precision and not cfg.bf16:
        raise ValueError(
            "bf16=False with use_mixed_precision=True asks for fp16 compute, which needs a "
            "gradient scaler this backend does not apply (fp16 gradients underflow silently): "
            "set bf16=true, or use_mixed_precision=false to train in fp32"
        )
    if cfg.fsdp_cpu_offload and not cfg.use_fsdp:
        raise ValueError("fsdp_cpu_offload=True needs use_fsdp=true: DDP does not offload")
    if cfg.use_dmuon and not cfg.use_fsdp:
        raise ValueError("use_dmuon=True needs use_fsdp=true: DMuon runs on FSDP2 shards")


def _check_nccl_env(cfg: Any) -> None:
    for key, value in cfg.nccl_env.items():
        if not (isinstance(key, str) and key.startswith(("NCCL_", "TORCH_NCCL_"))):
            raise ValueError(f"nccl_env key {key!r} must start with NCCL_ or TORCH_NCCL_")
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ValueError(f"nccl_env[{key!r}]={value!r} must be a string or int")


def _check_tensor_parallel(cfg: Any) -> None:
    tp = cfg.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be a positive int")
    if cfg.loss_parallel and tp == 1:
        raise ValueError(
            "loss_parallel=True needs tensor_parallel_size > 1 (it splits the logits over the "
            "tp group)"
        )
    if cfg.sequence_parallel and tp == 1:
        raise ValueError(
            "sequence_parallel=True needs tensor_parallel_size > 1 (it splits activations "
            "over the tp group)"
        )
    if tp == 1:
        return
    if not cfg.use_fsdp:
        raise ValueError(
            f"tensor_parallel_size={tp} needs use_fsdp=true: tensor parallelism composes with "
            "FSDP2 on the data-parallel sub-mesh, not with DDP"
        )


CONTEXT_PARALLEL_BACKENDS = ("auto", "ulysses", "ring")


def refuse_ring_off_cuda(why: str) -> None:
    raise ValueError(
        f"context_parallel_backend=ring needs CUDA workers{why}: torch's ring attention "
        "does not run on CPU (pytorch#147793); use ulysses, with cp dividing the heads"
    )


def _check_context_parallel(cfg: Any) -> None:
    cp = cfg.context_parallel_size
    _check_one_of(
        "context_parallel_backend", cfg.context_parallel_backend, CONTEXT_PARALLEL_BACKENDS
    )
    if cp < 1:
        raise ValueError(f"context_parallel_size={cp!r} must be a positive int")
    if cp == 1:
        return
    if not cfg.use_fsdp:
        raise ValueError(
            f"context_parallel_size={cp} needs use_fsdp=true: the cp ranks join FSDP2's shard "
            "axis (dp_shard x cp); DDP with context parallelism is not supported"
        )


def _check_expert_parallel(cfg: Any) -> None:
    ep = cfg.expert_parallel_size
    if ep < 1:
        raise ValueError(f"expert_parallel_size={ep!r} must be a positive int")
    if ep == 1:
        return
    if not cfg.use_fsdp:
        raise ValueError(
            f"expert_parallel_size={ep} needs use_fsdp=true: the ep ranks are carved out of "
            "FSDP2's shard axis (dp_shard x cp); DDP with expert parallelism is not supported"
        )
    if cfg.tensor_parallel_size > 1:
        raise ValueError(
            f"expert_parallel_size={ep} with tensor_parallel_size="
            f"{cfg.tensor_parallel_size} is not supported: the tp ranks share a batch and "
            "would dispatch every token tp times; use one of the two"
        )


def _check_pipeline_parallel(cfg: Any) -> None:
    pp, micro = cfg.pipeline_parallel_size, cfg.pipeline_microbatches
    _check_one_of("pipeline_schedule", cfg.pipeline_schedule, PIPELINE_SCHEDULES)
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size={pp!r} must be a positive int")
    if micro is not None and micro < 1:
        raise ValueError(f"pipeline_microbatches={micro!r} must be a positive int or null")
    virtual = cfg.pipeline_virtual_stages
    if virtual < 1 or (virtual > 1 and pp == 1):
        raise ValueError(
            f"pipeline_virtual_stages={virtual!r} must be a positive int, and 1 without "
            f"pipeline parallelism (pipeline_parallel_size={pp})"
        )
    _check_pipeline_split(cfg)
    if pp > 1:
        _check_pipeline_composition(cfg)


def _check_pipeline_split(cfg: Any) -> None:
    """``pipeline_split``: ``auto``, or one positive layer count per stage
    (``pipeline_parallel_size x pipeline_virtual_stages``); that they sum to
    the model's layers is checked where the model is known (``validate``,
    ``plan``, the split)."""
    split, pp = cfg.pipeline_split, cfg.pipeline_parallel_size
    if isinstance(split, str):
        if split != "auto":
            raise ValueError(
                f"pipeline_split={split!r} is not 'auto' or a list of layer counts, one per stage"
            )
        return
    shown = list(split)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
        raise ValueError(f"pipeline_split={shown}: every stage's layer count must be an int >= 1")
    if pp == 1:
        raise ValueError(f"pipeline_split={shown} needs pipeline_parallel_size > 1 (got 1)")
    stages = pp * cfg.pipeline_virtual_stages
    if len(split) != stages:
        raise ValueError(
            f"pipeline_split={shown} has {len(split)} entries; it needs one per pipeline stage: "
            f"pipeline_parallel_size={pp} x pipeline_virtual_stages="
            f"{cfg.pipeline_virtual_stages} = {stages}"
        )


def _check_pipeline_composition(cfg: Any) -> None:
    pp, micro = cfg.pipeline_parallel_size, cfg.pipeline_microbatches
    if not cfg.use_fsdp:
        raise ValueError(
            f"pipeline_parallel_size={pp} needs use_fsdp=true: each stage is FSDP2-sharded "
            "over its data-parallel ranks; DDP with pipeline parallelism is not supported"
        )
    if cfg.context_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={pp} with context_parallel_size={cfg.context_parallel_size} "
            "is not supported yet: use one of the two"
        )
    if cfg.sequence_parallel:
        raise ValueError(
            f"pipeline_parallel_size={pp} with sequence_parallel=true is not supported: the "
            "stages exchange whole sequences; leave it null"
        )
    if cfg.use_dmuon:
        raise ValueError(
            f"pipeline_parallel_size={pp} with use_dmuon=true is not supported yet: use one "
            "of the two"
        )
    if cfg.loss_parallel:
        raise ValueError(
            f"loss_parallel=true with pipeline_parallel_size={pp} is not supported: the last "
            "stage's loss and its backward run inside torch's pipeline schedule, outside "
            "ctx.loss_parallel(), so the vocabulary-split logits fail there and the other "
            "stages wait until the group times out; leave loss_parallel false (the last "
            "stage gathers its logits)"
        )
    if cfg.pipeline_schedule == "1f1b" and micro is not None and micro < pp:
        raise ValueError(
            f"pipeline_microbatches={micro} < pipeline_parallel_size={pp}: pipeline_schedule="
            "1f1b needs at least one micro-batch per stage"
        )
    errors = schedule_errors(cfg.pipeline_schedule, pp, cfg.pipeline_virtual_stages, micro)
    if errors:
        raise ValueError(errors[0])


def unknown_key_message(key: str, known: list[str], section: str = "distributed") -> str:
    """``unknown <section> config key 'x'; did you mean 'y'?`` (or the valid keys)."""
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(known)}"
    return f"unknown {section} config key {key!r}{hint}"


def build_checked(cls: type, section: str, values: Mapping[str, Any], problem_of) -> Any:
    """``cls(**values)`` for a dataclass section, after naming at once every
    unknown key (with its likely spelling) and every value that
    ``problem_of(key, value)`` finds wrong (it returns what is wrong, or None).

    Raises:
        ValueError: ``<section>.<key>=<value> <problem>``, joined by ``; ``."""
    known = [f.name for f in dataclasses.fields(cls)]
    problems = []
    for key, value in values.items():
        if key not in known:
            problems.append(unknown_key_message(key, known, section))
            continue
        problem = problem_of(key, value)
        if problem:
            problems.append(f"{section}.{key}={value!r} {problem}")
    if problems:
        raise ValueError("; ".join(problems))
    return cls(**values)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str, name: str = "max_shard_size") -> int:
    """Bytes in ``size``: an int, or ``"5GB"``/``"500MiB"``/``"20KB"`` (as
    Hugging Face's ``max_shard_size``: GB = 10**9, GiB = 2**30).

    Raises:
        ValueError: naming the value and the accepted forms.
    """
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{name}={size!r} is not a positive size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
