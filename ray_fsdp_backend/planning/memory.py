"""PURE per-GPU memory estimate for parameters, gradients and optimizer state.

Used by ``ray-fsdp plan`` to say, before anything starts, whether a model and
layout fit. The estimate counts model state only, the part that the strategy
changes; activations depend on batch size, sequence length and activation
checkpointing and are left out (and said to be).

What each strategy keeps on one GPU (``N`` parameters, ``S`` ranks per shard
group, ``U`` parameters in the largest FSDP unit, ``c`` bytes per parameter
in the compute dtype, ``r`` in the gradient-reduction dtype):

============================  ==========  ==========  ===============  ======================
strategy                      params      grads       optimizer        transient
============================  ==========  ==========  ===============  ======================
DDP                           4 N         4 N         state(N)         4 N  (reducer buckets)
full_shard / hybrid_shard     4 N / S     4 N / S     state(N) / S     2 c U + r U
shard_grad_op / _zero2        4 N / S     4 N / S     state(N) / S     c N + r U
============================  ==========  ==========  ===============  ======================

With tensor parallelism (``T`` ranks per tp group) each matrix is split
over the tp group before FSDP shards it, so the sharded terms divide by
``S T`` and the unsharded units by ``T`` (norms, replicated over tp, are
counted as split: they are a few thousand parameters).

``state`` is 8 bytes per parameter for AdamW (two fp32 moments) and, for
Muon, 4 bytes per parameter of the blocks' weight matrices (one momentum) plus
AdamW's 8 for the rest. Frozen parameters (a LoRA base, ``F`` of the ``N``)
take ``f`` bytes each (their dtype) and no gradient or optimizer state:
the params column becomes ``4 (N - F) + f F`` and the gradients and
optimizer state count the ``N - F`` trainable parameters only; reduction
buffers hold at most the trainable ones. ``full_shard`` keeps two units unsharded at a time
(the running one and the prefetched next); the ZeRO-2 modes keep every unit
unsharded from forward until its backward. With CPU offload the sharded
parameters, gradients and optimizer state live in host memory instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ray_fsdp_backend.settings.config import ShardingStrategy

FP32_BYTES = 4
ADAMW_STATE_BYTES = 2 * FP32_BYTES
MUON_STATE_BYTES = FP32_BYTES
OPTIMIZERS = ("adamw", "muon")

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk of :func:`~ray_fsdp_backend.ops.loss.linear_cross_entropy`
when ``chunk_size`` is None, and ``train.loss_chunk_tokens``' default (here,
with the plan arithmetic, so the config reads it without torch).
``benchmarks.fused_loss`` on CPU (151,936 words, 1k-2k tokens) measured the
peak falling with the chunk (669 / 1,262 / 2,449 MiB at 512 / 1,024 / 2,048
tokens) and the time the same within the noise of a shared machine; 1,024
keeps one chunk of a 262k vocabulary near 2 GiB of fp32 logits and
gradient, and makes matmuls of 1,024 rows, large enough for a GPU
(docs/benchmarks.md)."""


@dataclass(frozen=True)
class ModelSize:
    """The parameter counts the estimate needs, e.g. from ``ModelConfig``."""

    num_params: int
    """All parameters (a tied weight counted once)."""

    largest_unit_params: int
    """Parameters of the largest FSDP unit (a transformer block, or the root)."""

    matrix_params: int = 0
    """Parameters Muon updates (the blocks' trainable 2-D weights); the rest use AdamW."""

    frozen_params: int = 0
    """Parameters that are not trained (a LoRA base): no gradient, no optimizer state."""

    @property
    def trainable_params(self) -> int:
        return self.num_params - self.frozen_params


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by kind; ``host`` is what CPU offload keeps in host memory."""

    params: int
    grads: int
    optimizer: int
    transient: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.transient


def compute_optimizer_state_bytes(size: ModelSize, optimizer: str) -> int:
    """Optimizer state for the whole (unsharded) model, in bytes."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"train.optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if optimizer == "adamw":
        return ADAMW_STATE_BYTES * size.trainable_params
    rest = size.trainable_params - size.matrix_params
    return MUON_STATE_BYTES * size.matrix_params + ADAMW_STATE_BYTES * rest


def estimate_memory(
    size: ModelSize,
    strategy: ShardingStrategy | None,
    shard_size: int,
    *,
    optimizer: str = "adamw",
    mixed_precision: bool = True,
    reduce_fp32: bool = False,
    cpu_offload: bool = False,
    accumulate_unsharded: bool = False,
    tensor_parallel: int = 1,
    frozen_bytes: int = FP32_BYTES,
) -> MemoryEstimate:
    """Per-GPU bytes of model state for one strategy; ``strategy=None`` is DDP.

    Args:
        size: parameter counts of the model.
        strategy: the FSDP sharding strategy, or None for DDP.
        shard_size: ranks that split the parameters (the mesh's ``dp_shard``
            size); ignored for DDP.
        optimizer: ``adamw`` or ``muon``.
        mixed_precision: compute in a 16-bit dtype (unsharded copies are 2 bytes).
        reduce_fp32: reduce gradients in fp32 even under mixed precision.
        cpu_offload: keep sharded state in host memory (FSDP only).
        accumulate_unsharded: ``no_sync`` keeps every unit's full gradient
            (``r N`` more, transient across micro-batches; FSDP only).
        tensor_parallel: ranks of a tp group (each holds ``1 / T`` of every
            matrix; FSDP only).
        frozen_bytes: bytes per frozen parameter (2 for a bf16 LoRA base).

    Raises:
        ValueError: unknown optimizer, or ``shard_size`` or
            ``tensor_parallel`` < 1.
    """
    if shard_size < 1 or tensor_parallel < 1:
        raise ValueError(
            f"shard_size={shard_size} and tensor_parallel={tensor_parallel} must be at least 1"
        )
    state = compute_optimizer_state_bytes(size, optimizer)
    n, trained = size.num_params, size.trainable_params
    weights = FP32_BYTES * trained + frozen_bytes * size.frozen_params
    if strategy is None:
        return MemoryEstimate(weights, FP32_BYTES * trained, state, FP32_BYTES * trained)
    # A tp rank holds 1/T of every matrix: as if the model were T times smaller.
    n, unit = math.ceil(n / tensor_parallel), math.ceil(size.largest_unit_params / tensor_parallel)
    trained, weights = math.ceil(trained / tensor_parallel), math.ceil(weights / tensor_parallel)
    state = math.ceil(state / tensor_parallel)
    compute = 2 if mixed_precision else FP32_BYTES
    reduce = FP32_BYTES if (reduce_fp32 or not mixed_precision) else compute
    if strategy.reshard_after_forward:
        unsharded = 2 * compute * unit
    else:
        unsharded = compute * n
    transient = unsharded + reduce * min(unit, trained)
    if accumulate_unsharded:
        transient += reduce * trained
    sharded = MemoryEstimate(
        params=math.ceil(weights / shard_size),
        grads=math.ceil(FP32_BYTES * trained / shard_size),
        optimizer=math.ceil(state / shard_size),
        transient=transient,
    )
    if not cpu_offload:
        return sharded
    host = sharded.params + sharded.grads + sharded.optimizer
    return MemoryEstimate(params=0, grads=0, optimizer=0, transient=transient, host=host)


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of a mixture-of-experts decoder (docs/moe.md)."""

    moe_layers: int
    """Layers whose MLP is routed experts."""

    num_experts: int
    """Routed experts per MoE layer."""

    top_k: int
    """Experts each token is sent to."""

    dim: int
    """Width of the residual stream: what a token carries to its experts."""

    expert_hidden: int
    """Each expert's SwiGLU hidden width (``moe_intermediate_size``)."""

    @property
    def layer_params(self) -> int:
        """One MoE layer's experts: gate, up and down projections each."""
        return 3 * self.num_experts * self.dim * self.expert_hidden

    @property
    def params(self) -> int:
        return self.moe_layers * self.layer_params


@dataclass(frozen=True)
class ExpertTraffic:
    """Bytes one rank sends per optimizer step for the experts, by collective."""

    all_to_all: int
    all_gather: int
    reduce_scatter: int

    @property
    def total(self) -> int:
        return self.all_to_all + self.all_gather + self.reduce_scatter


def estimate_expert_memory(
    experts: ExpertShape, strategy: ShardingStrategy, shard_size: int, ep: int, **kwargs
) -> MemoryEstimate:
    """Per-GPU model state of the routed experts: an ep rank holds ``1 / ep``
    of every MoE layer's experts, FSDP2-sharded over the ``shard_size / ep``
    efsdp ranks, and gathers one layer's ``1 / ep`` at a time. ``kwargs``
    are :func:`estimate_memory`'s (tensor parallelism excepted: EP refuses it).

    Raises:
        ValueError: ``ep`` does not divide ``shard_size`` or the expert count.
    """
    if ep < 1 or shard_size % ep or experts.num_experts % ep:
        raise ValueError(
            f"expert_parallel_size={ep} must divide dp_shard x cp = {shard_size} and the "
            f"expert count {experts.num_experts}"
        )
    held = ModelSize(
        num_params=experts.params // ep, largest_unit_params=experts.layer_params // ep
    )
    return estimate_memory(held, strategy, shard_size // ep, **kwargs)


def estimate_expert_traffic(
    experts: ExpertShape,
    tokens: int,
    *,
    ep: int,
    shard_size: int,
    micro_batches: int = 1,
    reshard_after_forward: bool = True,
    value_bytes: int = 2,
    reduce_bytes: int = 2,
) -> ExpertTraffic:
    """Bytes a rank sends per step for the experts, ``tokens`` being the
    tokens it routes per step (its rows x sequence / cp, all micro-batches).

    With EP (``ep > 1``) each MoE layer moves the rank's ``tokens x top_k``
    hidden vectors to the experts' ranks and back (dispatch and combine), in
    forward and again in backward (their gradients): ``4 L t k h`` values, of
    which ``(ep - 1) / ep`` leave the rank under even routing. Both with and
    without EP, FSDP2 all-gathers the experts a rank holds (``P / ep``) over
    the ``s = shard_size / ep`` ranks sharding them, once per micro-batch in
    forward and again in backward under ``reshard_after_forward``, and
    reduce-scatters their gradient once per step (the trainer syncs on the
    last micro-batch only); a ring moves ``(s - 1) / s`` of the tensor.
    Without EP (``ep = 1``) that is every expert over the whole shard group.
    """
    efsdp = shard_size // ep
    exchanged = 4 * experts.moe_layers * tokens * experts.top_k * experts.dim * value_bytes
    held = experts.params // ep
    gathers = micro_batches * (2 if reshard_after_forward else 1)
    return ExpertTraffic(
        all_to_all=exchanged * (ep - 1) // ep,
        all_gather=gathers * held * value_bytes * (efsdp - 1) // efsdp,
        reduce_scatter=held * reduce_bytes * (efsdp - 1) // efsdp,
    )


def format_count(n: int, digits: int = 1) -> str:
    """A parameter count in millions (``25.8M``, ``70,553.7M``) as ``plan``
    prints them, or whole below 0.1M, where millions would round to nothing
    (``1,296``, never ``0.0M``)."""
    if n < 100_000:
        return f"{n:,}"
    return f"{n / 1e6:,.{digits}f}M"


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


@dataclass(frozen=True)
class ActivationShape:
    """What the activation estimate needs of a decoder and its batch."""

    n_layers: int
    dim: int
    n_heads: int
    vocab_size: int
    seq_len: int
    micro_batch_size: int


def estimate_activations(
    shape: ActivationShape,
    *,
    cp: int = 1,
    tp: int = 1,
    value_bytes: int = 4,
    attention_scores: bool = True,
    checkpointing: bool = False,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    logits: bool = True,
) -> int:
    """Bytes one rank saves for backward in one micro-batch (an estimate).

    Per layer, Korthikanti et al. 2022 (arXiv:2205.05198, section 4): with
    ``s`` tokens, ``b`` rows, width ``h`` and ``a`` heads, ``s b h (34 + 5 a s / h)``
    bytes at 2 bytes per value, of which ``5 a s / h`` is the attention-score
    term (absent with flash / memory-efficient kernels: ``attention_scores=False``)
    and ``24`` the part tensor parallelism (here with sequence parallelism)
    divides. Context parallelism divides the tokens a rank holds (``s / cp``)
    while each token still attends over the whole sequence: Ulysses keeps
    ``a / cp`` heads of all ``s`` tokens, so every term falls as ``1 / cp``.
    Without sequence parallelism tp divides only the ``24`` (and scores)
    inside attention and MLP: ``10 + 24 / tp``.
    Activation checkpointing keeps only each block's input (``2 s b h``,
    split over tp with sequence parallelism).
    Logits (``s b V``, plus their fp32 copy for the loss) come on top,
    divided by tp only with loss parallelism (else gathered on every rank);
    ``logits=False`` leaves them out (the chunked loss keeps none:
    :func:`estimate_loss_memory`).
    """
    s, b, h = shape.seq_len // cp, shape.micro_batch_size, shape.dim
    scale = value_bytes / 2
    sp = sequence_parallel or tp == 1
    if checkpointing:
        per_layer = 2 * s * b * h / (tp if sp else 1)
    else:
        scores = 5 * shape.n_heads * shape.seq_len / h if attention_scores else 0
        per_layer = s * b * h * ((34 + scores) / tp if sp else 10 + (24 + scores) / tp)
    logits_bytes = 0
    if logits:
        logits_bytes = s * b * shape.vocab_size * (value_bytes + FP32_BYTES)
        logits_bytes /= tp if loss_parallel else 1
    return int(shape.n_layers * per_layer * scale + logits_bytes)


def estimate_loss_memory(
    tokens: int,
    vocab: int,
    dim: int,
    *,
    chunk: int,
    tp: int = 1,
    value_bytes: int = 4,
    loss_parallel: bool = False,
) -> int:
    """Peak bytes one rank's cross-entropy adds for ``tokens`` tokens (an estimate).

    ``chunk`` > 0 (:func:`~ray_fsdp_backend.ops.loss.linear_cross_entropy`): one
    chunk's logits in the compute dtype, fp32 and their softmax-gradient
    (``chunk x V x (value_bytes + 8)``), the fp32 weight-gradient sum
    (``V x dim x 4``) and a log-sum-exp per token; under tp each rank holds
    its vocabulary slice (``V / tp``). ``chunk`` 0, the full logits:
    ``tokens x V`` in the compute dtype, their fp32 copy (log-softmax) and
    its gradient (``value_bytes + 8``), split over tp only with loss
    parallelism."""
    if chunk > 0:
        words = vocab // tp
        return min(chunk, tokens) * words * (value_bytes + 8) + words * dim * 4 + tokens * 4
    return tokens * vocab * (value_bytes + 8) // (tp if loss_parallel else 1)


@dataclass(frozen=True)
class TensorParallelTraffic:
    """What one decoder block moves over its tp group for one micro-batch
    (forward and backward): collectives by kind, and the bytes one rank
    sends for them (ring algorithms)."""

    collectives: dict[str, int]
    """``{"all_gather": n, ...}`` over forward, recompute and backward."""

    sent: int
    """Bytes one rank sends for them."""


def estimate_tp_block_traffic(
    shape: ActivationShape,
    *,
    tp: int,
    cp: int = 1,
    value_bytes: int = 4,
    sequence_parallel: bool = True,
    checkpointing: bool = False,
) -> TensorParallelTraffic:
    """Tensor-parallel traffic of one block per micro-batch, as torchtitan's.

    The attention and the MLP each take their input once for all their
    column-wise layers and reduce their row-wise output once. With sequence
    parallelism that is one all-gather and one reduce-scatter each in
    forward, and again in backward (the gradients: a reduce-scatter of the
    input's, an all-gather of the output's); without, one all-reduce each in
    forward and one in backward. Activation checkpointing runs the forward's
    again in backward, less the MLP's output reduction (torch's checkpoint
    stops recomputing once backward's saved tensors are back). Each
    collective carries the block's whole activation, ``A = (s / cp) b h``
    values: a ring sends ``(T - 1) / T A`` per all-gather or reduce-scatter
    and twice that per all-reduce, ``8 (T - 1) / T A`` per block either way
    without checkpointing.
    """
    if tp == 1:
        return TensorParallelTraffic(collectives={}, sent=0)
    gathers = 4 + (2 if checkpointing else 0)
    reductions = 4 + (1 if checkpointing else 0)
    if sequence_parallel:
        counts, units = {"all_gather": gathers, "reduce_scatter": reductions}, gathers + reductions
    else:  # the replicated input needs no gather; an all-reduce sends twice
        counts, units = {"all_reduce": reductions}, 2 * reductions
    activation = shape.seq_len // cp * shape.micro_batch_size * shape.dim * value_bytes
    return TensorParallelTraffic(collectives=counts, sent=units * activation * (tp - 1) // tp)
