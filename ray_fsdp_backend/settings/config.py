"""``FSDPSettings``: the one typed, validated configuration of the backend.

Its fields are the seed strategy's config keys plus the backend's own. Every
field is checked when the object is built, in the driver, before any worker
exists (Ray's ``TorchTrainer`` later fills an unset ``backend``, which
:func:`ray_fsdp_backend.runtime.backend.resolve_pg_backend` accounts for); checks
that need the cluster layout run first thing in ``Backend.on_start`` (see
:mod:`ray_fsdp_backend.planning.topology`).

This module is the bottom of the package: it imports nothing from it but its
checks (:mod:`ray_fsdp_backend.settings.checks`), and nothing from Ray. Ray's
``TorchConfig`` contract asks the config for its backend class
(``backend_cls``), and the backend needs every layer in between (topology,
mesh, strategies, context), so the Ray-facing subclass,
:class:`ray_fsdp_backend.runtime.backend.FSDPConfig` (``rfb.FSDPConfig``), lives beside
the backend it names. Everything below the backend (topology, memory, mesh,
strategies, context, ``build_strategy`` in a torchrun job) reads these plain
settings, so it can be used and tested without Ray.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ray_fsdp_backend.settings.checks import (
    UNEVEN_NODE_POLICIES,
    ShardingStrategy,
    check_settings,
    check_str_list,
    refuse_ring_off_cuda,
    resolve_strategy,
    unknown_key_message,
)

__all__ = [
    "UNEVEN_NODE_POLICIES",
    "FSDPSettings",
    "NumberLoader",
    "ShardingStrategy",
    "parse_yaml",
    "unknown_key_message",
]


@dataclass
class FSDPSettings:
    """How the backend distributes a model over the worker group.

    ``backend``, ``init_method`` and ``timeout_s`` mirror Ray's ``TorchConfig``
    fields (Ray's trainer assigns ``backend`` on ``rfb.FSDPConfig``, so it stays
    a plain field). Construction validates every field and raises
    ``ValueError`` naming the field, the value and what is allowed.
    """

    backend: str | None = None
    """Process-group backend. None picks NCCL when workers have GPUs (with a
    gloo CPU backend beside it when ``fsdp_cpu_offload`` is on) and gloo
    otherwise."""

    init_method: str = "env"
    """How ranks rendezvous: ``env`` (MASTER_ADDR/MASTER_PORT) or ``tcp``."""

    timeout_s: int = 1800
    """Seconds a collective may block before the process group fails it. A rank
    that hangs makes the run fail (and restart under ``FailureConfig``) after
    this long instead of hanging forever."""

    storage_retry_s: float | None = None
    """Seconds one storage operation of the backend (a checkpoint file's
    upload, a ranged read, the listing, a delete, a pretrained file's read)
    may spend retrying transient object-store failures (throttling, 5xx,
    dropped connections) before the run fails; 0: no retries. None: 120 s, or
    half of ``timeout_s`` when that is shorter. Must be below ``timeout_s``:
    the other ranks wait for a retrying one in a collective. See
    docs/checkpoints.md."""

    use_fsdp: bool = False
    """Shard the model with FSDP2 (True) or replicate it with DDP (False)."""

    fsdp_sharding_strategy: str = ShardingStrategy.FULL_SHARD.value
    """``full_shard`` and ``shard_grad_op`` shard over all ranks (1-D mesh);
    ``hybrid_shard`` and ``_hybrid_shard_zero2`` (also spelled
    ``hybrid_shard_zero2``) shard inside a node and replicate across nodes
    (2-D mesh). The ``shard_grad_op`` modes keep parameters unsharded between
    forward and backward (ZeRO-2)."""

    fsdp_hsdp_replicate_size: int | None = None
    """HSDP replicate-axis size. None: one replica per node, i.e. shard inside
    each node and replicate across nodes. Only valid with a hybrid strategy."""

    hsdp_uneven_nodes: str = "error"
    """HSDP on nodes with unequal worker counts (e.g. an elastic restart after
    a node came back with fewer GPUs), when ``fsdp_hsdp_replicate_size`` is
    unset: ``error`` refuses at start with the counts; ``split_nodes`` shards
    over groups of ``gcd(workers per node)`` ranks, each inside one node, and
    replicates across the groups; ``full_shard`` shards over all ranks (1-D
    mesh, cross-node traffic). Equal nodes are unaffected."""

    fsdp_hsdp_shard_across_nodes: bool = False
    """With an explicit ``fsdp_hsdp_replicate_size``: allow ``dp_shard`` groups
    that span nodes (their all-gathers and reduce-scatters then cross the
    slower inter-node network). False refuses such a layout at start."""

    fsdp_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in pinned CPU
    memory (``CPUOffloadPolicy``). Needs GPU workers; CPU workers have nothing
    to offload and train without it."""

    use_mixed_precision: bool = True
    """Compute in bf16 with fp32 master weights (FSDP2's policy; DDP's
    forward under autocast); False trains in full fp32."""

    bf16: bool = True
    """The mixed-precision compute dtype is bfloat16. False (the seed's
    float16) is refused under mixed precision: fp16 needs a gradient scaler,
    which this backend does not apply, and its gradients underflow silently
    without one."""

    fsdp_reduce_dtype: str = "bf16"
    """Dtype of FSDP gradient reduction under mixed precision: ``bf16`` or
    ``fp32``."""

    fsdp_accumulate_unsharded: bool = False
    """What ``no_sync`` does under FSDP. False: every micro-batch's gradients
    are still reduce-scattered, so each rank only ever holds its gradient
    shard (HSDP skips only the cross-replica all-reduce until the synced
    micro-batch). True: skip the reduce-scatter too and accumulate full,
    unsharded gradients on every rank (less communication, but memory for the
    whole model's gradients; ``ray-fsdp plan`` counts it)."""

    use_gradient_checkpointing: bool = False
    """Recompute activations in backward: the model's own
    ``gradient_checkpointing_enable()`` when it has one, otherwise activation
    checkpointing on each sharded block."""

    find_unused_parameters: bool = False
    """DDP only: allow parameters that get no gradient in a step."""

    broadcast_buffers: bool = True
    """DDP only: broadcast rank 0's buffers at every forward."""

    bucket_cap_mb: float = 25
    """DDP only: gradient all-reduce bucket size in MiB."""

    tensor_parallel_size: int = 1
    """Ranks that split each layer's matrices (tensor parallelism, the
    innermost mesh axis ``tp``: neighbouring ranks of one node). The model is
    split by its TP plan first, then FSDP2 shards over the remaining
    data-parallel ranks, mesh ``(dp_shard, tp)`` or, with a hybrid strategy,
    ``(dp_replicate, dp_shard, tp)``. Must divide every node's worker count;
    needs ``use_fsdp``. With ``use_dmuon`` owners gather whole matrices over tp."""

    sequence_parallel: bool | None = None
    """Under tensor parallelism, also split norms and dropout along the
    sequence (activations between blocks divided by tp). None: on when
    ``tensor_parallel_size > 1`` (and no pipeline: a stage's boundary
    activations are whole sequences)."""

    context_parallel_size: int = 1
    """Ranks that split each sequence (context parallelism, mesh axis ``cp``,
    just inside ``dp_shard``; cp x tp neighbouring ranks of one node). The
    ranks of one cp group read the same rows, each keeps ``seq / cp`` tokens
    of them (``ctx.shard_sequence``); FSDP2 shards over ``dp_shard`` x ``cp``
    and averages gradients over them, so the exact loss is the token sum over
    ``ctx.global_token_count`` (docs/long-context.md, "The loss rule"); DMuon's
    matrices get their gradients from the same reduction. Needs ``use_fsdp``."""

    context_parallel_backend: str = "auto"
    """``ulysses`` (all-to-all around attention: any device, any kernel,
    packed rows; needs attention heads per tp rank divisible by cp),
    ``ring`` (torch's ring attention: CUDA only, no packing; sequence
    divisible by 2 x cp) or ``auto`` (Ulysses when the heads allow, else ring
    on GPUs)."""

    expert_parallel_size: int = 1
    """Ranks that split the experts of every mixture-of-experts layer
    (expert parallelism, mesh axis ``ep``). The ep ranks are carved out of the
    data-parallel shard ranks ``dp_shard`` x ``cp`` as torchtitan does (E must
    divide it): ep rank r holds experts ``[r*N/E, (r+1)*N/E)`` and the tokens
    routed to them travel there by all-to-all; the experts are FSDP2-sharded
    over the remaining ``dp_shard x cp / E`` ranks (axis ``efsdp``). Dense
    modules, the data each rank reads and the loss rule are unchanged. 1: no
    expert parallelism, every mesh as before. Needs ``use_fsdp``; not with
    ``tensor_parallel_size > 1``. With ``use_dmuon`` each rank orthogonalises
    the whole expert matrices it holds (no exchange). See docs/moe.md."""

    loss_parallel: bool = False
    """Under tensor parallelism, keep the output head's logits split over the
    vocabulary (a DTensor) for a cross-entropy computed inside
    ``ctx.loss_parallel()``, backward included: no rank holds the full
    ``batch x seq x vocab`` logits. False gathers them (plain tensors)."""

    use_dmuon: bool = False
    """Train with the distributed Muon runtime (:mod:`ray_fsdp_backend.dmuon`).
    Needs ``use_fsdp``; composes with tensor, context and expert parallelism
    (every expert's matrix orthogonalised on its own)."""

    fsdp_block_classes: tuple[str, ...] = ()
    """Class names of the modules sharded as one FSDP unit each (transformer
    blocks). Empty: every child of every ``nn.ModuleList``. Ignored when the
    model provides ``convert_to_fsdp``."""

    compile: bool | str = "auto"
    """``torch.compile`` each block (those the wrap policy finds) before
    sharding, as torchtitan does; the rest of the model runs eagerly.
    ``auto``: on for CUDA workers (1.4x the eager step of the 1B preset on
    an H200), off on CPU workers; a model without blocks then runs eagerly
    with a warning. ``true`` / ``false`` force it (``true`` needs blocks, and
    a C++ compiler on CPU workers)."""

    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one worker's device, for MFU. None: looked up for
    known accelerators by the compute dtype (no MFU on CPU or unknown ones)."""

    nccl_env: dict[str, str] = field(default_factory=dict)
    """Environment variables set on every worker before the process group is
    created, e.g. ``{"NCCL_SOCKET_IFNAME": "eth0"}``. Keys must start with
    ``NCCL_`` or ``TORCH_NCCL_``."""

    pipeline_parallel_size: int = 1
    """Pipeline stages (mesh axis ``pp``, the outermost: consecutive node
    groups, one stage each). Each stage holds a contiguous run of layers
    (the embedding on the first, final norm and head on the last) and is
    FSDP2-sharded over the data-parallel ranks of its own node group;
    ``ctx.pipeline_step`` runs the schedule. Must divide the world size;
    needs ``use_fsdp``; composes with expert parallelism inside a stage (ep
    over the stage's data-parallel ranks); not with context parallelism or
    DMuon. See docs/parallelism.md."""

    pipeline_schedule: str = "1f1b"
    """torch.distributed.pipelining's schedule. One stage per rank: ``1f1b``
    (one forward, one backward: at most P micro-batches' activations in
    flight) or ``gpipe`` (all forwards, then all backwards: M in flight);
    both idle ``(P - 1) / (M + P - 1)`` of a step (the bubble). Several
    (``pipeline_virtual_stages``) per rank: ``interleaved_1f1b`` (Megatron's
    interleaving, bubble ``(P - 1) / (V M + P - 1)``),
    ``interleaved_zero_bubble`` (torch's ScheduleInterleavedZeroBubble: the
    weight gradients fill the bubble); ``zbv_zero_bubble`` (torch's
    ScheduleZBVZeroBubble) is refused: its ``eval()`` fails on torch 2.13.
    See docs/parallelism.md."""

    pipeline_virtual_stages: int = 1
    """Pipeline stages each rank holds (V; torchtitan's and Megatron's
    virtual stages): the model is cut into ``P x V`` stages; rank r holds
    stages r, r + P, ... (``interleaved_*``). 1 for ``1f1b`` and ``gpipe``;
    at least 2 for the interleaved schedules."""

    pipeline_microbatches: int | None = None
    """Micro-batches each step's batch is split into (its rows must divide by
    it). None: the stage count. ``1f1b`` needs at least
    ``pipeline_parallel_size``; more shrinks the bubble."""

    pipeline_split: str | tuple[int, ...] = "auto"
    """Layers per pipeline stage, one count per stage
    (``pipeline_parallel_size x pipeline_virtual_stages`` of them, in stage
    order, summing to the model's layers), e.g. ``[7, 8, 8, 7]``. ``auto``:
    balanced with the embedding and the head counted as a layer each (as
    torchtitan), the extra layers on the last stages, which keep the fewest
    micro-batches in flight under 1F1B
    (:func:`~ray_fsdp_backend.planning.pipeline_layout.balanced_split`).
    ``ray-fsdp plan`` prints the split and each stage's memory."""

    def __post_init__(self) -> None:
        self.fsdp_sharding_strategy = resolve_strategy(self.fsdp_sharding_strategy).value
        self.fsdp_block_classes = tuple(
            check_str_list("fsdp_block_classes", self.fsdp_block_classes)
        )
        if isinstance(self.pipeline_split, list):
            self.pipeline_split = tuple(self.pipeline_split)
        check_settings(self)

    # -- public helpers -------------------------------------------------

    def compiles_on(self, device_type: str) -> bool:
        """Whether blocks are compiled on a worker of ``device_type``
        (``compile: auto`` resolved: on for ``cuda`` only)."""
        if self.compile == "auto":
            return device_type == "cuda"
        return bool(self.compile)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """``fsdp_sharding_strategy`` as an enum."""
        return ShardingStrategy(self.fsdp_sharding_strategy)

    @property
    def sequence_parallel_enabled(self) -> bool:
        """``sequence_parallel`` resolved: its default follows tensor parallelism."""
        if self.sequence_parallel is None:
            return self.tensor_parallel_size > 1 and self.pipeline_parallel_size == 1
        return self.sequence_parallel

    def resolve_cp_backend(self, n_heads: int, device_type: str) -> str:
        """``context_parallel_backend`` for a model with ``n_heads`` attention
        heads on ``device_type`` workers: ``"ulysses"`` or ``"ring"``.

        Raises:
            ValueError: ring on CPU, or Ulysses with heads per tp rank not
                divisible by cp (naming the keys).
        """
        cp, tp, choice = self.context_parallel_size, self.tensor_parallel_size, None
        heads = n_heads // tp
        fits = heads % cp == 0
        if self.context_parallel_backend == "auto":
            choice = "ulysses" if fits else "ring"
        else:
            choice = self.context_parallel_backend
        if choice == "ulysses" and not fits:
            raise ValueError(
                f"context_parallel_backend=ulysses splits heads over cp: {n_heads} heads / "
                f"tensor_parallel_size={tp} = {heads} per tp rank is not divisible by "
                f"context_parallel_size={cp}. Choose a cp size dividing {heads}, or ring on GPUs"
            )
        if choice == "ring" and device_type != "cuda":
            why = "" if fits else f" ({heads} heads per tp rank do not split over cp={cp})"
            refuse_ring_off_cuda(why)
        return choice

    def check_cp_device(self, device_type: str) -> None:
        """Refuse ``context_parallel_backend=ring`` on workers without CUDA
        (the backend calls it before any worker is set up).

        Raises:
            ValueError: ring on CPU workers.
        """
        ring = self.context_parallel_size > 1 and self.context_parallel_backend == "ring"
        if ring and device_type != "cuda":
            refuse_ring_off_cuda("")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> FSDPSettings:
        """Build from a mapping of field names; an unknown key is an error that
        suggests the closest valid one."""
        if not isinstance(values, Mapping):
            raise ValueError(f"distributed config must be a mapping, got {type(values).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ValueError("; ".join(unknown_key_message(k, known) for k in unknown))
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> FSDPSettings:
        """Build from the ``distributed:`` section of a training YAML file."""
        with open(path) as f:
            doc = parse_yaml(f) or {}
        if not isinstance(doc, Mapping) or "distributed" not in doc:
            raise ValueError(f"{os.fspath(path)}: no 'distributed:' section")
        return cls.from_dict(doc["distributed"] or {})

    @property
    def storage_retry_budget_s(self) -> float:
        """``storage_retry_s`` with its default resolved against ``timeout_s``."""
        if self.storage_retry_s is not None:
            return float(self.storage_retry_s)
        return min(120.0, self.timeout_s / 2)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as ``from_dict`` accepts it back."""
        out = dataclasses.asdict(self)
        out["fsdp_block_classes"] = list(self.fsdp_block_classes)
        if not isinstance(self.pipeline_split, str):
            out["pipeline_split"] = list(self.pipeline_split)
        return out


class NumberLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads ``2e-3`` and ``1e4`` as numbers
    (YAML 1.2 and every user do; PyYAML's 1.1 rules want ``2.0e-3``)."""


NumberLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text) -> Any:
    """A YAML document or value (a string or a file), numbers as users write them."""
    return yaml.load(text, Loader=NumberLoader)  # noqa: S506 - a SafeLoader subclass
