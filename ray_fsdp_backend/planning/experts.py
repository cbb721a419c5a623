"""PURE: what ``ray-fsdp plan`` prints for a mixture-of-experts model.

:func:`moe_model_from_hf` reads the shape of a Qwen3-MoE / Qwen2-MoE /
Mixtral / DeepSeek-V3 ``config.json`` (the keys differ by family);
:func:`format_moe_plan` prints the model state per GPU split into the dense
part (attention, embeddings, norms, routers, shared experts, dense MLP
layers: sharded over dp_shard x cp as without EP) and the routed experts
(split over ep, sharded over efsdp), and the bytes each rank sends per step
for the experts with the configured ``expert_parallel_size`` beside ep 1
(all-gather and reduce-scatter of every expert, no all-to-all). See
docs/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_fsdp_backend.planning.memory import (
    ExpertShape,
    MemoryEstimate,
    ModelSize,
    estimate_expert_memory,
    estimate_expert_traffic,
    estimate_memory,
    format_bytes,
)

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Qwen2/3-MoE, Mixtral and DeepSeek-V3 name the routed expert count each their way."""


@dataclass(frozen=True)
class MoEModel:
    """A mixture-of-experts decoder's parameter counts, dense part apart."""

    dense: ModelSize
    """Everything but the routed experts."""

    experts: ExpertShape

    @property
    def num_params(self) -> int:
        return self.dense.num_params + self.experts.params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: the dense part and top-k experts."""
        e = self.experts
        return self.dense.num_params + e.moe_layers * e.top_k * 3 * e.dim * e.expert_hidden


def moe_model_from_hf(hf: dict) -> MoEModel | None:
    """The counts of a transformers MoE ``config.json`` (as a dict); None for
    a dense one. Layer ``i`` is an MoE layer unless it is one of DeepSeek's
    ``first_k_dense_replace`` first layers, in Qwen's ``mlp_only_layers``, or
    off Qwen's ``decoder_sparse_step``. Shared experts (Qwen2-MoE's
    ``shared_expert_intermediate_size``, DeepSeek's ``n_shared_experts``)
    count as dense; so do the routers (``hidden x experts``)."""
    count = next((hf[k] for k in EXPERT_COUNT_KEYS if hf.get(k)), None)
    if count is None:
        return None
    d, n_layers = hf["hidden_size"], hf["num_hidden_layers"]
    expert_hidden = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    step, dense_only = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    first_dense = hf.get("first_k_dense_replace") or 0
    moe_layers = sum(
        1
        for i in range(n_layers)
        if i >= first_dense and i not in dense_only and (i + 1) % step == 0
    )
    shared = hf.get("shared_expert_intermediate_size") or 0
    shared += (hf.get("n_shared_experts") or 0) * expert_hidden
    around = _attention_params(hf) + 2 * d  # attention and the two norms of a layer
    dense_layer = around + 3 * d * hf["intermediate_size"]
    moe_layer = around + d * count + 3 * d * shared
    vocab = hf["vocab_size"]
    embedding = vocab * d + d + (0 if hf.get("tie_word_embeddings") else vocab * d)
    blocks = (n_layers - moe_layers) * dense_layer + moe_layers * moe_layer
    unit = max(dense_layer if moe_layers < n_layers else moe_layer, embedding)
    dense = ModelSize(blocks + embedding, unit, matrix_params=blocks - 2 * d * n_layers)
    experts = ExpertShape(moe_layers, count, hf["num_experts_per_tok"], d, expert_hidden)
    return MoEModel(dense, experts)


def _attention_params(hf: dict) -> int:
    """One layer's attention projections: grouped-query (``head_dim`` when
    given, Qwen3's 128 at width 2048) or DeepSeek's multi-head latent
    attention (``kv_lora_rank``: low-rank q and kv projections)."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("kv_lora_rank"):
        rope, nope, v = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"], hf["v_head_dim"]
        q_rank, kv_rank = hf.get("q_lora_rank"), hf["kv_lora_rank"]
        q = d * q_rank + q_rank * heads * (nope + rope) if q_rank else d * heads * (nope + rope)
        kv = d * (kv_rank + rope) + kv_rank * heads * (nope + v)
        return q + kv + heads * v * d
    head_dim = hf.get("head_dim") or d // heads
    kv_heads = hf.get("num_key_value_heads") or heads
    return 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim


@dataclass(frozen=True)
class MoEPlanInputs:
    """What the MoE lines need of the run besides the model."""

    strategy: object
    """The FSDP sharding strategy (EP needs FSDP)."""
    shard_size: int
    """dp_shard x cp: the ranks the dense part is sharded over."""
    ep: int
    tokens: int
    """Tokens one rank routes per step (all micro-batches)."""
    micro_batches: int
    memory_kwargs: dict
    """:func:`~ray_fsdp_backend.planning.memory.estimate_memory`'s options."""


def format_moe_plan(model: MoEModel, run: MoEPlanInputs, optimizer: str) -> list[str]:
    """The ``model:`` line, the memory table (dense / experts / total) and
    the experts' traffic at ``run.ep`` beside ep 1."""
    e = model.experts
    kwargs = dict(run.memory_kwargs, optimizer=optimizer)
    dense = estimate_memory(model.dense, run.strategy, run.shard_size, **kwargs)
    experts = estimate_expert_memory(e, run.strategy, run.shard_size, run.ep, **kwargs)
    dense_m = model.dense.num_params / 1e6
    lines = [
        f"model:    {model.num_params / 1e6:,.1f}M parameters: {dense_m:,.1f}M dense, "
        f"{e.params / 1e6:,.1f}M in {e.moe_layers} MoE layers of {e.num_experts} "
        f"experts (top-{e.top_k}: {model.active_params / 1e6:,.1f}M active per token), "
        f"optimizer {optimizer}",
        "per-GPU memory, model state only (activations below); dense sharded over "
        f"{run.shard_size}, experts split over ep={run.ep} x efsdp={run.shard_size // run.ep}:",
        f"  {'':<12}{'dense':>10}{'experts':>11}{'total':>11}",
    ]
    for label in ("parameters", "gradients", "optimizer", "transient", "total"):
        a, b = _field(dense, label), _field(experts, label)
        lines.append(
            f"  {label:<12}{format_bytes(a):>10}{format_bytes(b):>11}{format_bytes(a + b):>11}"
        )
    return lines + format_expert_traffic(e, run)


def format_expert_traffic(experts: ExpertShape, run: MoEPlanInputs) -> list[str]:
    """Bytes per rank per step for the experts, at ``run.ep`` and at ep 1."""
    kwargs = dict(
        micro_batches=run.micro_batches,
        reshard_after_forward=run.strategy.reshard_after_forward,
        value_bytes=2 if run.memory_kwargs.get("mixed_precision", True) else 4,
        reduce_bytes=4 if _reduces_fp32(run.memory_kwargs) else 2,
    )
    sizes = (run.ep, 1) if run.ep > 1 else (1,)
    traffic = [
        estimate_expert_traffic(experts, run.tokens, ep=ep, shard_size=run.shard_size, **kwargs)
        for ep in sizes
    ]
    header = "".join(f"{f'ep={ep}':>11}" for ep in sizes)
    lines = [
        f"expert traffic sent per rank per step ({run.tokens:,} tokens routed per rank, "
        f"top-{experts.top_k}, {run.micro_batches} micro-batch(es)):",
        f"  {'':<15}{header}",
    ]
    for label in ("all_to_all", "all_gather", "reduce_scatter", "total"):
        values = "".join(f"{format_bytes(getattr(t, label)):>11}" for t in traffic)
        lines.append(f"  {label.replace('_', '-'):<15}{values}")
    return lines


def _field(est: MemoryEstimate, label: str) -> int:
    names = {"parameters": "params", "gradients": "grads"}
    return getattr(est, names.get(label, label))


def _reduces_fp32(kwargs: dict) -> bool:
    return kwargs.get("reduce_fp32", False) or not kwargs.get("mixed_precision", True)
