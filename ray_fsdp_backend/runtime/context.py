"""``TrainContext``: what ``train_loop_per_worker`` gets from ``get_context()``."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ray_fsdp_backend.compat.peft import peft_configs, refuse_tied_adapters
from ray_fsdp_backend.context_parallel.apply import disable_hf_cache
from ray_fsdp_backend.context_parallel.ring import ring_region
from ray_fsdp_backend.context_parallel.sequence import count_valid_tokens, shard_sequence
from ray_fsdp_backend.distributed.mesh import pipeline_group
from ray_fsdp_backend.distributed.seeding import seed_step
from ray_fsdp_backend.planning.topology import (
    CP_AXIS,
    EP_AXIS,
    PP_AXIS,
    TP_AXIS,
    MeshLayout,
    Topology,
)
from ray_fsdp_backend.runtime.offload import offload, onload
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.strategies.base import DistributionStrategy

if TYPE_CHECKING:
    from ray_fsdp_backend.checkpoint.ray_run import RunCheckpoints

_CONTEXT: TrainContext | None = None


@dataclass
class TrainContext:
    """One worker's view of the run: its strategy, mesh, device and place in
    the cluster. Built by the backend on every worker before the training
    function starts."""

    config: FSDPSettings
    strategy: DistributionStrategy
    mesh: DeviceMesh
    layout: MeshLayout
    topology: Topology
    device: torch.device
    world_rank: int
    _checkpoints: RunCheckpoints | None = field(default=None, init=False, repr=False)
    """The run's checkpoint state (the save in flight, what Ray registered),
    created on the first save or restore; ``close`` drops it."""

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank(self.world_rank)

    @property
    def node_rank(self) -> int:
        return self.topology.node_rank(self.world_rank)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (``dp_replicate`` x ``dp_shard``): the
        world size divided by the model-parallel (tp) degree."""
        return self.layout.data_parallel_coordinates(self.world_rank)[1]

    @property
    def dp_rank(self) -> int:
        """This rank's data shard index; the ranks of one tp group share it and
        must read the same batch."""
        return self.layout.data_parallel_coordinates(self.world_rank)[0]

    @property
    def tp_size(self) -> int:
        """Ranks in this rank's tensor-parallel group (1 without TP)."""
        return self.layout.axis_size(TP_AXIS)

    @property
    def tp_rank(self) -> int:
        """Position in the tensor-parallel group (0 without TP)."""
        return self.layout.coordinates(self.world_rank).get(TP_AXIS, 0)

    @property
    def cp_size(self) -> int:
        """Ranks in this rank's context-parallel group (1 without CP)."""
        return self.layout.axis_size(CP_AXIS)

    @property
    def cp_rank(self) -> int:
        """Position in the context-parallel group (0 without CP): which part of
        each sequence this rank holds."""
        return self.layout.coordinates(self.world_rank).get(CP_AXIS, 0)

    @property
    def ep_size(self) -> int:
        """Ranks that split the experts (``expert_parallel_size``; 1 without EP)."""
        return self.layout.expert_parallel_size

    @property
    def ep_rank(self) -> int:
        """Position in the expert-parallel group (``mesh["ep"]``; 0 without EP):
        this rank holds experts ``[ep_rank * N / ep_size, (ep_rank + 1) * N / ep_size)``."""
        if self.ep_size == 1:
            return 0
        return self.layout.expert_coordinates(self.world_rank)[EP_AXIS]

    @property
    def pp_size(self) -> int:
        """Pipeline stages (``pipeline_parallel_size``; 1 without PP)."""
        return self.layout.axis_size(PP_AXIS)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (``mesh["pp"]``; 0 without PP)."""
        return self.layout.coordinates(self.world_rank).get(PP_AXIS, 0)

    def pipeline_step(
        self, model: nn.Module, batch: dict[str, torch.Tensor], loss_fn=None
    ) -> torch.Tensor:
        """Forward and backward of this step's ``batch`` (``input_ids``,
        ``labels`` unshifted) through the pipeline stage ``model`` (as
        :meth:`wrap` returned it), ``pipeline_schedule`` over
        ``pipeline_microbatches``; returns the step's loss on every rank
        (``loss_fn(logits, shifted_labels)``, a token sum, default
        cross-entropy, over :meth:`global_token_count`). Then clip and step;
        several calls before one step add their means (docs/parallelism.md).
        See :func:`ray_fsdp_backend.pipeline.step.pipeline_step`.

        Raises:
            ValueError: without ``pipeline_parallel_size > 1``, or rows not
                divisible by the micro-batch count.
        """
        from ray_fsdp_backend.pipeline.step import pipeline_step

        if self.pp_size == 1:
            raise ValueError("ctx.pipeline_step needs pipeline_parallel_size > 1")
        return pipeline_step(self, model, batch, loss_fn)

    def wrap(self, model: nn.Module, *, tp_plan: dict | None = None) -> nn.Module:
        """Shard (FSDP2/HSDP) or replicate (DDP) ``model`` as configured; with
        ``tensor_parallel_size > 1`` first split it over the tp group by
        ``tp_plan`` (``{module pattern: "colwise" | "rowwise" | ...}``) or the
        model's own plan; with ``pipeline_parallel_size > 1`` it is first cut
        to this rank's stage, or its ``pipeline_virtual_stages`` stages
        (``ray_fsdp_backend.pipeline.split``: original parameter names kept);
        with ``context_parallel_size > 1`` its attention becomes Ulysses (or
        ring) over the cp group. A transformers model runs without its cache on
        every layout (``use_cache`` defaults to True even in train mode, and
        with a cache transformers builds no per-document mask from packed
        rows' ``position_ids``: they would attend across documents); its
        config keeps its own value. See docs/parallelism.md. A ``peft`` model (frozen
        base, trainable adapters) wraps the same way; built on the meta device,
        its adapters get PEFT's own initialisation (docs/lora.md); one with
        ``modules_to_save``, or with an adapter on a tied weight (LoRA on a
        tied ``lm_head``), is refused (ValueError)."""
        refuse_modules_to_save(model)
        refuse_tied_adapters(model)
        if self.pp_size > 1:  # a stage's forward runs without a cache
            from ray_fsdp_backend.pipeline.split import split_for_stages
            from ray_fsdp_backend.planning.pipeline_schedules import stage_indices

            virtual, schedule = self.config.pipeline_virtual_stages, self.config.pipeline_schedule
            held = stage_indices(self.pp_rank, self.pp_size, virtual, schedule)
            split = self.config.pipeline_split
            model = split_for_stages(model, held, self.pp_size * virtual, split)
        else:
            disable_hf_cache(model)
        return self.strategy.wrap(model, tp_plan=tp_plan)

    def loss_parallel(self):
        """Context manager for the loss and its backward: torch's
        ``loss_parallel`` when ``loss_parallel`` keeps the logits split over
        the vocabulary, else a no-op (so loops can always use it)."""
        return self.strategy.loss_parallel()

    def shard_sequence(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This cp rank's part of every ``[batch, seq]`` tensor in ``batch``
        (``input_ids``, ``labels``, ``position_ids``, ``attention_mask``, ...).
        ``labels`` are shifted before the split (then the loss takes them as
        they are), ``position_ids`` are made when absent; pass them to the
        model. Without CP: the whole rows, labels shifted all the same. See
        :func:`~ray_fsdp_backend.context_parallel.sequence.shard_sequence`."""
        ring = self.strategy.cp_backend == "ring"
        return shard_sequence(batch, self.cp_rank, self.cp_size, load_balance=ring)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel process group (``mesh["cp"]``), None without CP."""
        return self.mesh[CP_AXIS].get_group() if self.cp_size > 1 else None

    def sequence_log_probs(
        self,
        model: nn.Module,
        batch: dict[str, torch.Tensor],
        *,
        temperature: float = 1.0,
        chunk_tokens: int | None = None,
        compile: bool = False,
        entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Each token's log-probability of its target under ``model``: fp32
        ``[rows, seq]``, 0 where ``batch["targets"]`` is -100; with
        ``entropy``, also each token's entropy of the tempered distribution
        (from the same chunks: ``(log_probs, entropies)``, the entropies not
        differentiable).

        ``batch`` is a micro-batch as :meth:`shard_sequence` returned it
        (``input_ids``, ``targets``, ``position_ids``, passed to the model).
        The model runs with its output head computing one position a row and
        the log-probs come from the head's input and weight chunk by chunk
        (:func:`~ray_fsdp_backend.ops.loss.linear_token_log_probs`: never the
        ``[tokens, vocab]`` fp32 logits; vocabulary-parallel under a tp head;
        the model's logit soft-cap and scale applied as it would). A model
        whose head is not a bias-free ``nn.Linear`` (a LoRA adapter on it), or
        ``chunk_tokens=0``, takes ``log_softmax`` of its whole logits. Under
        the ring cp backend call it inside :meth:`sequence_region`, with the
        backward.

        Args:
            model: the wrapped model (example decoder or transformers causal LM).
            batch: the micro-batch (see above).
            temperature: divides the (soft-capped) logits, as vLLM's sampler.
            chunk_tokens: tokens per chunk (None: the default chunk; 0: whole logits).
            compile: compile the per-chunk math (``torch.compile``).
            entropy: also return the per-token entropies (0 off target).

        Raises:
            ValueError: a ``temperature`` not above 0, a batch without
                ``input_ids`` or ``targets``, or pipeline parallelism (a stage
                holds part of the model; see :meth:`pipeline_step`).
        """
        from ray_fsdp_backend.ops.head import (
            head_hidden_states,
            keep_head_gathered,
            resolve_loss_head,
        )
        from ray_fsdp_backend.ops.loss import linear_token_log_probs, logits_token_log_probs

        if self.pp_size > 1:
            raise ValueError(
                f"ctx.sequence_log_probs runs the whole model: pipeline_parallel_size="
                f"{self.pp_size} splits it into stages"
            )
        missing = [key for key in ("input_ids", "targets") if key not in batch]
        if missing:
            raise ValueError(f"batch has no {missing} (keys: {sorted(batch)})")
        inputs, targets = batch["input_ids"], batch["targets"]
        position_ids = batch.get("position_ids")
        head = None if chunk_tokens == 0 else resolve_loss_head(model)
        if head is None:
            output = model(inputs, position_ids=position_ids)
            logits = getattr(output, "logits", output)  # a transformers model's output
            return logits_token_log_probs(logits, targets, temperature=temperature, entropy=entropy)
        keep_head_gathered(model, head)
        hidden, _ = head_hidden_states(model, head, inputs, position_ids=position_ids)
        return linear_token_log_probs(
            hidden,
            head.module.weight,
            targets,
            chunk_size=chunk_tokens,
            softcap=head.softcap,
            temperature=temperature,
            compile=compile,
            entropy=entropy,
        )

    def seed_step(self, seed: int, step: int) -> None:
        """Seed this rank's generators for ``step`` as ``ray-fsdp train`` does
        every step: from ``seed``, ``step`` and this rank's dp, cp and pp
        coordinates, so ranks holding different tokens (or, under pp,
        different layers) draw different dropout masks even when every rank
        was seeded alike, the ranks of a tp group
        draw alike (attention heads a tp rank holds alone draw apart), and a
        resumed run draws at ``step`` what an uninterrupted one does. Call it
        at the start of each step, after the model is built (its
        initialisation uses ``seed`` alone). See docs/parallelism.md."""
        seed_step(self, seed, step)

    def sequence_region(self) -> AbstractContextManager:
        """Run each micro-batch's forward *and* backward inside it: with
        ``context_parallel_backend`` resolved to ring, SDPA becomes torch's
        ring attention over the cp group there; otherwise it does nothing."""
        if self.strategy.cp_backend != "ring":
            return contextlib.nullcontext()
        return ring_region(self.mesh[CP_AXIS])

    def global_token_count(self, labels: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """The divisor of the token-exact loss: the valid targets (not -100)
        of the whole optimizer step over every data-parallel rank, divided by
        the number of ranks the strategy averages gradients over (dp x cp).
        ``labels``: this rank's labels as :meth:`shard_sequence` returned
        them, or a list of every micro-batch's labels of the step under
        gradient accumulation. One all-reduce.

        Every strategy averages gradients over the dp x cp ranks (tp ranks
        hold the same labels), so ``token_sum / ctx.global_token_count(labels)``
        summed over the step's micro-batches has the gradient of the mean over
        every valid token of the step, on every layout, and the mean of the
        ranks' losses is that global mean (docs/long-context.md, "The loss
        rule"). The step's token count itself is this times ``dp_size x cp_size``."""
        parts = [labels] if isinstance(labels, torch.Tensor) else list(labels)
        return self.global_count(sum(count_valid_tokens(part) for part in parts))

    def global_count(self, count: torch.Tensor) -> torch.Tensor:
        """The divisor of a loss that is a mean over any unit of the step (a
        token, a sequence, a preference pair): ``count``, this rank's units
        of the step, summed over every rank and divided by the number of
        ranks gradients are averaged over, so that ``loss_sum / divisor``
        has the gradient of the step's mean on every layout (see
        :meth:`global_token_count`). At least 1. One all-reduce."""
        count = count.detach().to(torch.float32, copy=True)  # reduced in place
        if not dist.is_initialized():
            return count.clamp(min=1.0)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        # Summed over every rank, each tp group's count appears tp times: the
        # world size divides out tp and the dp x cp average at once.
        return count.clamp(min=1.0) / dist.get_world_size()

    def clip_grad_norm(
        self,
        model: nn.Module,
        max_norm: float | None,
        *,
        norm_type: float = 2.0,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """One global-norm clip over all gradients, on every mesh (``norm_type``
        as torch's: 2, 1, inf, any p; ``max_norm=None``: measure only);
        returns the pre-clip norm. Skip the step when it is not finite:
        ``ray_fsdp_backend.distributed.step_guard.step_if_finite(optimizer, norm)`` does
        without a host sync."""
        return self.strategy.clip_grad_norm(
            model, max_norm, norm_type=norm_type, optimizer=optimizer
        )

    def no_sync(self, model: nn.Module):
        """Context manager for accumulation micro-batches."""
        return self.strategy.no_sync(model)

    def autocast(self):
        """A no-op kept for older loops: ``wrap`` already applies the
        configured mixed precision (FSDP2's policy, DDP's autocast forward)."""
        return self.strategy.autocast()

    def step_meter(
        self,
        model: nn.Module,
        *,
        seq_len: int,
        total_steps: int | None = None,
        start_step: int = 0,
        start_tokens: int = 0,
        flops_per_token: float | None = None,
    ):
        """A :class:`~ray_fsdp_backend.metrics.reporting.StepMeter` for this rank: tokens/s,
        step time, TFLOP/s, MFU, peak memory and ETA at each ``measure(step)``.
        FLOPs per token default to an estimate read off ``model`` (a decoder
        transformer); the peak is ``config.peak_tflops`` or the known
        accelerator's for the compute dtype (none on CPU: no MFU)."""
        from ray_fsdp_backend.metrics.flops import compute_dtype, resolve_peak_flops
        from ray_fsdp_backend.metrics.reporting import StepMeter, estimate_flops_per_token

        cfg = self.config
        if flops_per_token is None:
            flops_per_token = estimate_flops_per_token(model, seq_len, cfg.fsdp_block_classes)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        dtype = compute_dtype(cfg.use_mixed_precision, cfg.bf16)
        return StepMeter(
            device=self.device,
            flops_per_token=flops_per_token,
            peak_flops=resolve_peak_flops(name, dtype, cfg.peak_tflops),
            total_steps=total_steps,
            start_step=start_step,
            start_tokens=start_tokens,
        )

    def router_stats(self, model: nn.Module):
        """A :class:`~ray_fsdp_backend.metrics.router.RouterStats` on the wrapped
        ``model``: per-layer expert load of a mixture-of-experts model, counted
        on the device; call its ``collect()`` on logging steps only (every rank,
        collective) for ``{"router/layer{i}/max_over_mean": ...}`` over the
        global batch (under pipeline parallelism each stage counts its own
        layers). See docs/moe.md."""
        from ray_fsdp_backend.metrics.router import RouterStats

        return RouterStats(model, stages=self.pp_size > 1)

    def save_checkpoint(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        metrics: dict,
        *,
        extra_state: dict | None = None,
        async_save: bool = False,
    ) -> None:
        """Write a sharded checkpoint (every rank its own shard, plus its RNG
        state and ``extra_state``: step, data position, scheduler state) and
        report it to Ray with ``metrics``. Every rank calls it at the same step;
        see :mod:`ray_fsdp_backend.checkpoint`. With ``async_save`` it returns
        once the state is copied to host memory and the write overlaps the
        next steps (one save in flight; the checkpoint is committed and
        registered only when every rank's files are written)."""
        self.checkpoints.save(
            model,
            optimizer,
            metrics,
            extra_state=extra_state,
            strategy=type(self.strategy).__name__,
            async_save=async_save,
        )

    def restore_checkpoint(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        checkpoint=None,
    ) -> dict | None:
        """Load the newest complete checkpoint of the run into ``model`` and
        ``optimizer`` (resharding if the world size or strategy changed) and
        restore RNG state; returns the saved ``extra_state``, or None when there
        is nothing to resume. Without a checkpoint of its own the run loads
        ``checkpoint`` (a ``ray.train.Checkpoint``, e.g. another run's) or the
        one Ray hands it. Every rank calls it."""
        return self.checkpoints.restore(model, optimizer, checkpoint=checkpoint)

    @property
    def checkpoints(self) -> RunCheckpoints:
        """This worker's :class:`~ray_fsdp_backend.checkpoint.RunCheckpoints`
        for the run, created on first use."""
        if self._checkpoints is None:
            # Imported on use: torch.distributed.checkpoint adds ~0.2 s to every worker's start.
            from ray_fsdp_backend.checkpoint import RunCheckpoints

            self._checkpoints = RunCheckpoints()
        return self._checkpoints

    def stream_weights(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int | str | None = None,
        dtype=None,
        adapters: bool = False,
    ):
        """Yield ``model``'s full weights as ``[(hf_name, tensor), ...]``
        buckets of at most ``bucket_bytes`` (None: 512 MiB): the tensors ``export_model``
        writes (adapters merged, experts per expert), gathered one at a time,
        for a rollout engine's weight reload. ``adapters=True`` (a LoRA
        model): the adapters alone, the tensors of ``export_model(...,
        format="peft")`` under PEFT's names, for an engine that keeps its
        base. Collective: every rank iterates to the end and receives every
        bucket, on every layout (a pipeline stage receives the other stages'
        tensors over ``mesh["pp"]``; adapters: not under pp). See
        :func:`~ray_fsdp_backend.hf.stream.stream_weights` and
        :func:`~ray_fsdp_backend.hf.adapter_stream.stream_adapters`."""
        if adapters:
            from ray_fsdp_backend.hf.adapter_stream import stream_adapters

            return stream_adapters(model, bucket_bytes=bucket_bytes, dtype=dtype)
        from ray_fsdp_backend.hf.stream import stream_weights

        group = pipeline_group(self.mesh)
        return stream_weights(model, bucket_bytes=bucket_bytes, dtype=dtype, pipeline_group=group)

    def offload(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Free the device memory of ``model``'s parameters, gradients and
        buffers and of ``optimizer``'s state until :meth:`onload` (a
        colocated rollout engine's turn): their bytes go to host memory, the
        tensors stay the same objects, so the next step after :meth:`onload`
        is bit-identical to one without the round trip. Returns the bytes
        freed on this rank. See :mod:`~ray_fsdp_backend.runtime.offload`."""
        return offload(model, optimizer)

    def onload(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Bring back what :meth:`offload` freed (the same ``optimizer``).
        Returns the bytes restored on this rank."""
        return onload(model, optimizer)

    def close(self) -> None:
        """Drop the run's state (checkpoints and their async-save group);
        teardown calls it before destroying the process group."""
        if self._checkpoints is not None:
            self._checkpoints.close()
            self._checkpoints = None

    def export_model(
        self,
        model: nn.Module,
        path: str,
        *,
        filesystem=None,
        format: str = "hf",
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        overwrite: bool = False,
    ) -> str:
        """Write the full weights: by default a Hugging Face directory (sharded
        safetensors, index, ``config.json``, the tokenizer files of the
        checkpoint ``load_pretrained`` read) that ``from_pretrained`` loads,
        each rank writing its files straight into the store; a path ending in
        ``.safetensors`` (or ``format="safetensors"``) gives one file from rank
        0. ``path`` is local, a URI (``s3://``, ``gs://``) or a path on
        ``filesystem``. A non-empty target is refused unless ``overwrite=True``
        (which replaces its weights); the index is written only once every
        file is verified. Every rank calls it; returns ``path``. See
        :func:`ray_fsdp_backend.hf.export_model`."""
        from ray_fsdp_backend.hf import export_model

        return export_model(
            model,
            path,
            filesystem=filesystem,
            format=format,
            max_shard_size=max_shard_size,
            dtype=dtype,
            overwrite=overwrite,
        )

    def load_pretrained(
        self, model: nn.Module, path: str, *, filesystem=None, key_map=None, quantize=None
    ):
        """Load Hugging Face safetensors weights (a directory, a file, a URI or a
        path on ``filesystem``) into the wrapped ``model``, each rank reading
        only the byte ranges it owns. ``quantize="nf4"``: QLoRA's 4-bit frozen
        base, each rank quantising its own shard (docs/lora.md). Call after
        ``wrap``, before building the optimizer. See
        :func:`ray_fsdp_backend.hf.load_pretrained`."""
        from ray_fsdp_backend.hf import load_pretrained

        return load_pretrained(
            model, path, filesystem=filesystem, key_map=key_map, quantize=quantize
        )


def refuse_modules_to_save(model: nn.Module) -> None:
    """Raise ValueError when a peft adapter of ``model`` sets
    ``modules_to_save``: peft keeps trainable copies of those modules under
    names that neither the export (merged or adapters-only) nor a loader
    reads, so their training would be lost."""
    for adapter, config in peft_configs(model).items():
        saved = getattr(config, "modules_to_save", None)
        if saved:
            raise ValueError(
                f"peft adapter {adapter!r}: modules_to_save={sorted(saved)!r} is not supported "
                "(its trained copies would be missing from every export); leave it unset "
                "and add those modules' linear layers to target_modules"
            )


def get_context() -> TrainContext:
    """The calling worker's ``TrainContext``.

    Raises:
        RuntimeError: called outside ``train_loop_per_worker`` of a run whose
            ``torch_config`` (or ``backend_config``) is an ``FSDPConfig``.
    """
    if _CONTEXT is None:
        raise RuntimeError(
            "ray_fsdp_backend.get_context() is only available inside "
            "train_loop_per_worker of a TorchTrainer run with torch_config=FSDPConfig(...)"
        )
    return _CONTEXT


def set_context(context: TrainContext | None) -> None:
    """Install (or with None, clear) this process's context, closing the one
    it replaces (teardown clears it); backend use only."""
    global _CONTEXT
    if _CONTEXT is not None and _CONTEXT is not context:
        _CONTEXT.close()
    _CONTEXT = context
