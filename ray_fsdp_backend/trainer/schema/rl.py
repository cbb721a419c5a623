"""``train.objective: grpo``: the ``rollout:`` and ``reward:`` sections and their rules.

Next to ``train.grpo:`` (:class:`~ray_fsdp_backend.settings.policy.PolicyOptions`)::

    rollout:
      engine: hf                 # hf (transformers generate) | vllm
      replicas: 1                # rollout engine actors
      num_cpus: 1                # Ray resources of each engine
      num_gpus: 0
      python: null               # vllm: the python of its own environment
      temperature: 1.0
      top_p: 1.0
      max_tokens: 32             # longest response sampled
      bucket_bytes: 512MB        # weight sync bucket (ctx.stream_weights)
      sync: merged               # merged | adapters (model.lora: the adapters alone)
      transport: object_store    # object_store | collective (a gloo / NCCL group)
      colocate: false            # true: engines and trainer share the devices in turn
    reward: my_rewards:exact     # module:function (or {function: ..., chunk: 64})
    data:
      format: prompts            # records with a prompt (text or chat messages)
      path: prompts.jsonl

Every check names the field, the value and the rule and runs in
``validate`` / ``plan`` before Ray starts. No torch here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray_fsdp_backend.settings.checks import build_checked, parse_size

ENGINES = ("hf", "vllm")
SYNCS = ("merged", "adapters")
TRANSPORTS = ("object_store", "collective")
"""``rollout.transport``'s values (:mod:`ray_fsdp_backend.rl.transport`)."""
PROMPTS_FORMAT = "prompts"


@dataclass(frozen=True)
class RolloutOptions:
    """The ``rollout:`` section: the engines that sample for the policy."""

    engine: str = "hf"
    """``hf``: transformers ``generate`` (tests, tiny models, CPU clusters);
    ``vllm``: vLLM in its own Python environment (``python``)."""
    replicas: int = 1
    """Engine actors; each takes a contiguous block of the step's prompts."""
    num_cpus: float = 1
    """Ray CPUs of each engine actor."""
    num_gpus: float = 0
    """Ray GPUs of each engine actor."""
    python: str | None = None
    """``engine: vllm``: the Python executable of the environment vLLM is
    installed in (Ray's ``runtime_env`` ``py_executable``); null: this one."""
    dtype: str = "float32"
    """The engines' weight dtype (``float32`` | ``bfloat16``)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same)."""
    top_p: float = 1.0
    max_tokens: int = 32
    """The longest response sampled (tokens)."""
    bucket_bytes: int | str = "512MB"
    """Bytes per weight-sync bucket (``ctx.stream_weights``)."""
    sync: str = "merged"
    """What a weight sync sends: ``merged``, the whole model with the LoRA
    adapters merged into its weights; ``adapters`` (needs ``model.lora``),
    the adapters alone under PEFT's names: the engines keep the checkpoint's
    base and apply them (transformers: a PEFT model; vLLM: a ``LoRARequest``)."""
    transport: str = "object_store"
    """How the buckets reach the engines: ``object_store`` (Ray's: any
    hardware, any node) or ``collective`` (a process group of the trainer's
    rank 0 and the engines: NCCL when both are on GPUs, gloo otherwise)."""
    colocate: bool = False
    """The engines share the trainer's devices in turn: every trainer rank
    offloads its policy and optimizer (``ctx.offload``) for each rollout and
    onloads them after it, the engines sleep between rollouts, and they run
    on the trainer's nodes (``num_gpus`` below 1 shares a GPU; docs/rl.md)."""


@dataclass(frozen=True)
class RewardOptions:
    """The ``reward:`` section (``reward: module:function`` is its shorthand)."""

    function: str | None = None
    """``module:function`` with TRL's reward signature (docs/rl.md)."""
    chunk: int = 64
    """Completions per Ray task that runs the function."""


def normalise_reward(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with a ``reward: module:function`` string as its mapping form."""
    doc = dict(doc)
    if isinstance(doc.get("reward"), str):
        doc["reward"] = {"function": doc["reward"]}
    return doc


def build_rollout(values: Mapping[str, Any]) -> RolloutOptions:
    """Raises ValueError naming ``rollout.<key>``, its value and the rule."""
    return build_checked(RolloutOptions, "rollout", values, _rollout_problem)


def build_reward(values: Mapping[str, Any]) -> RewardOptions:
    """Raises ValueError naming ``reward.<key>``, its value and the rule."""
    return build_checked(RewardOptions, "reward", values, _reward_problem)


def _rollout_problem(key: str, value: Any) -> str | None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_number = (is_int or isinstance(value, float)) and math.isfinite(value)
    if key == "engine" and value not in ENGINES:
        return f"is not one of {', '.join(ENGINES)}"
    if key == "transport" and value not in TRANSPORTS:
        return f"is not one of {', '.join(TRANSPORTS)}"
    if key in ("replicas", "max_tokens") and not (is_int and value >= 1):
        return "must be an int >= 1"
    if key in ("num_cpus", "num_gpus") and not (is_number and value >= 0):
        return "must be a number >= 0"
    if key == "temperature" and not (is_number and value > 0):
        return "must be a positive number (the trainer's log-probs are at that temperature)"
    if key == "top_p" and not (is_number and 0 < value <= 1):
        return "must be a number in (0, 1]"
    if key == "sync" and value not in SYNCS:
        return f"is not one of {', '.join(SYNCS)}"
    if key == "dtype" and value not in ("float32", "bfloat16"):
        return "is not one of float32, bfloat16"
    if key == "python" and value is not None and not (isinstance(value, str) and value):
        return "must be a path to a Python executable or null"
    if key == "colocate" and not isinstance(value, bool):
        return "must be true or false"
    if key == "bucket_bytes":
        try:
            parse_size(value, "rollout.bucket_bytes")
        except ValueError:
            return "is not a positive size such as 512MB or 1GiB"
    return None


def _reward_problem(key: str, value: Any) -> str | None:
    if key == "function" and not (
        isinstance(value, str) and value.count(":") == 1 and all(value.split(":"))
    ):
        return "must be 'module:function'"
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key == "chunk" and not (is_int and value > 0):
        return "must be a positive int"
    return None


def rl_errors(built: Mapping[str, Any]) -> list[str]:
    """``train.objective: grpo`` against the other sections (each checked
    when the sections it involves built)."""
    train, data, model, dist = (built.get(k) for k in ("train", "data", "model", "distributed"))
    rollout, reward = built.get("rollout"), built.get("reward")
    grpo = train is not None and train.objective == "grpo"
    errors = []
    if data is not None and train is not None and grpo != (data.format == PROMPTS_FORMAT):
        errors.append(
            f"train.objective={train.objective!r} needs data.format='prompts' (records with a "
            f"prompt), got data.format={data.format!r}"
            if grpo
            else f"data.format='prompts' with train.objective={train.objective!r}: prompt "
            "records train an online-RL objective; set train.objective: grpo"
        )
    if not grpo:
        for name, section in (("rollout", rollout), ("reward", reward)):
            if section is not None and section != type(section)():
                errors.append(f"{name}: set only with train.objective: grpo")
        return errors
    if model is not None and getattr(model, "pretrained", None) is None:
        errors.append(
            "train.objective='grpo' needs model.pretrained: the rollout engines load the same "
            "Hugging Face checkpoint"
        )
    if reward is None or reward.function is None:
        errors.append("train.objective='grpo' needs reward: module:function (docs/rl.md)")
    if dist is not None:
        for key in ("pipeline_parallel_size", "context_parallel_size"):
            if getattr(dist, key) > 1:
                errors.append(
                    f"train.objective='grpo' with distributed.{key}={getattr(dist, key)}: not "
                    "supported yet (FSDP / HSDP, tp and ep are); the policy's rows are whole "
                    "sequences per rank"
                )
    lora = getattr(model, "lora", None) is not None
    if rollout is not None and rollout.sync == "adapters" and model is not None and not lora:
        errors.append(
            "rollout.sync='adapters' needs model.lora: without LoRA adapters there is only "
            "the whole model to send (rollout.sync: merged)"
        )
    if rollout is not None and rollout.sync == "adapters" and rollout.transport == "collective":
        errors.append(
            "rollout.sync='adapters' with rollout.transport='collective': the adapters (a few "
            "MB) go through the object store (rollout.transport: object_store)"
        )
    if rollout is not None and rollout.colocate and rollout.transport == "collective":
        if rollout.num_gpus > 0:
            errors.append(
                "rollout.colocate=true with rollout.transport='collective' and rollout.num_gpus="
                f"{rollout.num_gpus:g}: NCCL cannot join a trainer rank and an engine on one GPU "
                "(CUDA IPC is not built); use rollout.transport: object_store"
            )
    if train.grpo.normalisation == "fixed" and rollout is None:
        errors.append("train.grpo.normalisation='fixed' needs rollout.max_tokens")
    if rollout is not None and rollout.engine == "vllm" and rollout.python is not None:
        if not os.path.exists(rollout.python):
            errors.append(f"rollout.python={rollout.python!r} does not exist")
    return errors


def prompt_input_errors(data, model, rollout: RolloutOptions) -> list[str]:
    """What :func:`~ray_fsdp_backend.rl.prompts.read_prompts` refuses in
    ``data.path``: every record read and rendered with the checkpoint's
    tokenizer, each problem named ``FILE:LINE``."""
    from ray_fsdp_backend.hf.metadata import load_tokenizer
    from ray_fsdp_backend.rl.prompts import read_prompts

    try:
        tokenizer = load_tokenizer(model.pretrained)
    except (OSError, ValueError) as exc:
        return [f"model.pretrained={model.pretrained!r}: its tokenizer cannot be loaded: {exc}"]
    try:
        read_prompts(data.path, tokenizer, **prompt_options(data, model, rollout))
    except (OSError, ValueError) as exc:
        return [f"data.path={data.path!r}: {exc}"]
    return []


def prompt_options(data, model, rollout: RolloutOptions) -> dict[str, Any]:
    """``read_prompts``' keyword arguments from the sections."""
    return dict(
        seq_len=model.seq_len,
        max_tokens=rollout.max_tokens,
        prompt_field=data.prompt_field,
        tools_field=data.tools_field,
        roles=data.roles,
        chat_template=data.chat_template,
        chat_template_kwargs=data.chat_template_kwargs,
    )
