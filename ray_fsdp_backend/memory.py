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

from ray_fsdp_backend.config import ShardingStrategy

FP32_BYTES = 4
ADAMW_STATE_BYTES = 2 * FP32_BYTES
MUON_STATE_BYTES = FP32_BYTES
OPTIMIZERS = ("adamw", "muon")


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
    divided by tp only with loss parallelism (else gathered on every rank).
    """
    s, b, h = shape.seq_len // cp, shape.micro_batch_size, shape.dim
    scale = value_bytes / 2
    sp = sequence_parallel or tp == 1
    if checkpointing:
        per_layer = 2 * s * b * h / (tp if sp else 1)
    else:
        scores = 5 * shape.n_heads * shape.seq_len / h if attention_scores else 0
        per_layer = s * b * h * ((34 + scores) / tp if sp else 10 + (24 + scores) / tp)
    logits = s * b * shape.vocab_size * (value_bytes + FP32_BYTES) / (tp if loss_parallel else 1)
    return int(shape.n_layers * per_layer * scale + logits)
