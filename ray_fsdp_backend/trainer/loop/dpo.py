"""``train.objective: dpo``: the DPO family on preference pairs.

Per micro-batch (packed rows whose pairs are documents ``2p`` / ``2p + 1``,
``data.format: preference``): the policy's per-pair log-prob sums with
gradients (``rfb.pair_log_probs``, through the chunked head, never the
whole logits), the reference's without, and ``rfb.dpo_loss``'s per-pair
losses summed; the step divides by its pairs (one all-reduce), so the
gradient is the mean over the step's pairs whatever the layout.

The reference (``train.dpo.reference``):

- ``adapters``: the policy itself, a sharded ``PeftModel``, under
  ``disable_adapter()``: the frozen base, no second copy;
- ``frozen``: a second copy of the base, built and sharded like the policy
  and never stepped (its memory is what ``ray-fsdp plan`` prints);
- ``precompute``: before the first step, one forward pass of the policy
  (still the reference) over the training and held-out rows on the same
  workers and layout; the sums are all-gathered, so any rank finds any pair
  after a reshuffle, looked up by ``pair_index`` and kept in the checkpoint.

``simpo`` and ``orpo`` take no reference. Reference passes run in eval mode
(no dropout), as TRL's do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ray_fsdp_backend.context_parallel.sequence import IGNORE_INDEX
from ray_fsdp_backend.trainer.data.sft_batches import pad_rows
from ray_fsdp_backend.trainer.loop.objectives import (
    MicroBatchResult,
    Objective,
    global_pair_count,
    local_value,
    pair_indices,
)
from ray_fsdp_backend.trainer.loop.pretrained import build_frozen_base
from ray_fsdp_backend.trainer.schema.preference import Reference
from ray_fsdp_backend.trainer.schema.spec import RunSpec

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
"""TRL's names, means over the step's pairs (``eval/`` before them on the held-out set)."""


class PairStore:
    """Reference log-prob sums by ``pair_index``: sorted keys and ``[pairs, 2]``
    values (chosen, rejected) on the device, looked up without a host sync."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        order = torch.argsort(keys)
        self.keys, self.values = keys[order], values[order]

    def lookup(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = torch.searchsorted(self.keys, index).clamp(max=len(self.keys) - 1)
        found = self.values[at]
        return found[:, 0], found[:, 1]

    def state_dict(self) -> dict:
        return {"keys": self.keys.cpu(), "values": self.values.cpu()}

    @classmethod
    def from_state(cls, state: dict, device: torch.device) -> PairStore:
        return cls(state["keys"].to(device), state["values"].to(device))


class DPOObjective(Objective):
    """``rfb.dpo_loss`` over each micro-batch's pairs (docs/preference.md)."""

    def __init__(self, ctx, model: nn.Module, spec: RunSpec, head) -> None:
        super().__init__(spec, head)
        from ray_fsdp_backend.preference.log_probs import pair_log_probs
        from ray_fsdp_backend.preference.losses import dpo_loss

        self._pair_log_probs, self._dpo_loss = pair_log_probs, dpo_loss
        self.options = spec.train.dpo
        self.reference = self.options.resolve_reference(
            getattr(spec.model, "lora", None) is not None
        )
        frozen = self.reference is Reference.FROZEN
        self.frozen = build_frozen_base(ctx, spec.model) if frozen else None
        self.device = ctx.device
        self.stores: dict[str, PairStore] = {}
        """``precompute``: the reference's sums of the ``train`` and ``eval`` rows."""

    # -- the step ---------------------------------------------------------

    def count(self, ctx, micro_batches: list[dict]) -> torch.Tensor:
        """The step's pairs (over the dp size); under ``orpo`` also the scale
        that makes its NLL term the token mean over the step's chosen
        responses, as TRL's ``ORPOTrainer`` takes it (one more all-reduce)."""
        pairs = global_pair_count([(pair_indices(ctx, b) >= 0).sum() for b in micro_batches])
        if self.options.loss_type == "orpo":
            tokens = ctx.global_token_count([chosen_targets(b) for b in micro_batches])
            self._nll_scale = pairs / (tokens * ctx.cp_size)  # the step's pairs / chosen tokens
        return pairs

    _nll_scale: torch.Tensor | None = None

    def micro_batch(self, ctx, model: nn.Module, batch: dict, split: str = "train"):
        ref_chosen, ref_rejected = self.reference_sums(ctx, model, batch, split)
        policy = self.log_probs(ctx, model, batch)
        nll = None
        if self.options.loss_type == "orpo" and split == "train":
            # summed over the step's pairs and divided by them: -(chosen log-probs) / tokens
            nll = -policy.chosen * self._nll_scale
        result = self._dpo_loss(
            policy.chosen,
            policy.rejected,
            ref_chosen,
            ref_rejected,
            loss_type=self.options.loss_type,
            beta=self.options.beta,
            label_smoothing=self.options.label_smoothing,
            simpo_gamma=self.options.simpo_gamma,
            chosen_lengths=policy.chosen_tokens,
            rejected_lengths=policy.rejected_tokens,
            chosen_nll=nll,
        )
        return MicroBatchResult(result.losses.sum(), None, reward_sums(result))

    def log_probs(self, ctx, model: nn.Module, batch: dict):
        return self._pair_log_probs(
            ctx,
            model,
            batch,
            chunk_tokens=self.spec.train.loss_chunk_tokens,
            compile=self.spec.distributed.compiles_on(ctx.device.type),
        )

    def reference_sums(self, ctx, model: nn.Module, batch: dict, split: str):
        """The reference's chosen and rejected sums of ``batch``'s pairs (None, None: none)."""
        if self.reference is None:
            return None, None
        if self.reference is Reference.PRECOMPUTE:
            index = pair_indices(ctx, batch)
            return self.stores[split].lookup(index[index >= 0])
        reference = self.frozen if self.reference is Reference.FROZEN else model
        peft = model.module if isinstance(model, DistributedDataParallel) else model
        off = peft.disable_adapter() if self.reference is Reference.ADAPTERS else None
        with off or contextlib.nullcontext(), evaluating(reference), torch.no_grad():
            sums = self.log_probs(ctx, reference, batch)
        return sums.chosen, sums.rejected

    # -- the held-out set ---------------------------------------------------

    def evaluate(self, ctx, model: nn.Module, batches: Iterable[dict]) -> dict[str, float]:
        """``eval_loss`` (the mean pair loss) and ``eval/rewards/...`` over the
        whole held-out set; every rank its share of ``batches``. Collective."""
        totals = torch.zeros(len(REWARD_METRICS) + 2, device=ctx.device, dtype=torch.float64)
        with evaluating(model), torch.no_grad():
            for rows in batches:
                batch = ctx.shard_sequence(rows)
                with ctx.sequence_region(), ctx.loss_parallel():
                    result = self.micro_batch(ctx, model, batch, split="eval")
                pairs = (pair_indices(ctx, batch) >= 0).sum()
                sums = [result.total, *result.stats.values(), pairs]
                totals += torch.stack([local_value(v).double() for v in sums])
        if dist.is_initialized():  # tp and cp ranks add the same pairs: the ratio cancels
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        values = (totals[:-1] / totals[-1].clamp(min=1)).tolist()
        names = ["eval_loss", *(f"eval/{name}" for name in REWARD_METRICS)]
        return dict(zip(names, values, strict=True))

    # -- precompute ------------------------------------------------------

    def before_training(self, ctx, model: nn.Module, rows: Callable, held_out) -> None:
        """``precompute`` (and no store restored from the checkpoint): one
        forward pass over ``rows()`` (this rank's training micro-batches, whole
        rows) and ``held_out()`` (its share of the held-out ones)."""
        if self.reference is not Reference.PRECOMPUTE or self.stores:
            return
        splits = {"train": rows, "eval": held_out}
        for split, source in splits.items():
            if source is not None:
                self.stores[split] = self.precompute(ctx, model, source())

    def precompute(self, ctx, model: nn.Module, micro_batches: Iterable[dict]) -> PairStore:
        """The policy's (= the reference's, before any step) pair sums of
        ``micro_batches``, gathered from every rank. Collective: ranks with
        fewer micro-batches run empty ones."""
        batches = [{k: v.to(ctx.device) for k, v in b.items()} for b in micro_batches]
        runs = torch.tensor([len(batches)], device=ctx.device)
        if dist.is_initialized():
            dist.all_reduce(runs, op=dist.ReduceOp.MAX)
        keys, values = [], []
        with evaluating(model), torch.no_grad():
            for i in range(int(runs)):
                batch = ctx.shard_sequence(batches[i] if i < len(batches) else empty(batches, ctx))
                with ctx.sequence_region(), ctx.loss_parallel():
                    sums = self.log_probs(ctx, model, batch)
                index = pair_indices(ctx, batch)
                keys.append(index[index >= 0])
                values.append(
                    torch.stack([local_value(sums.chosen), local_value(sums.rejected)], 1)
                )
        keys = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.long, device=ctx.device)
        values = torch.cat(values) if values else torch.zeros(0, 2, device=ctx.device)
        return PairStore(*gather_pairs(keys, values.float()))

    def state_dict(self) -> dict:
        return {split: store.state_dict() for split, store in self.stores.items()}

    def load_state_dict(self, state: dict) -> None:
        if self.reference is Reference.PRECOMPUTE:
            self.stores = {k: PairStore.from_state(v, self.device) for k, v in state.items()}


def reward_sums(result) -> dict[str, torch.Tensor]:
    """Sums over the pairs of :data:`REWARD_METRICS` (TRL's accuracies: the
    chosen reward above the rejected one)."""
    chosen, rejected = result.chosen_rewards.detach(), result.rejected_rewards.detach()
    sums = [chosen.sum(), rejected.sum(), (chosen - rejected).sum()]
    sums.append((chosen > rejected).float().sum())
    return dict(zip(REWARD_METRICS, sums, strict=True))


def chosen_targets(batch: dict) -> torch.Tensor:
    """``batch``'s targets in chosen responses only (-100 elsewhere)."""
    sequence_ids = batch["sequence_ids"]
    chosen = (sequence_ids >= 0) & (sequence_ids % 2 == 0)
    return torch.where(chosen, batch["targets"], IGNORE_INDEX)


def gather_pairs(keys: torch.Tensor, values: torch.Tensor):
    """Every rank's ``(keys, values)``, concatenated and without repeats (the
    ranks of a tp / cp group hold the same pairs)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return keys, values
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (keys.cpu(), values.cpu()))
    keys = torch.cat([k for k, _ in parts])
    values = torch.cat([v for _, v in parts])
    unique, first = _first_of_each(keys)
    return unique.to(values.device), values[first].to(keys.device)


def _first_of_each(keys: torch.Tensor):
    unique, inverse = torch.unique(keys, return_inverse=True)
    first = torch.full((len(unique),), len(keys), dtype=torch.long, device=keys.device)
    first.scatter_reduce_(0, inverse, torch.arange(len(keys), device=keys.device), reduce="amin")
    return unique, first


def empty(batches: list[dict], ctx) -> dict:
    """A micro-batch like ``batches[0]`` holding no pair (a rank with fewer rows)."""
    like = batches[0] if batches else None
    if like is None:
        raise ValueError("precompute: a rank has no training rows at all")
    none = {k: v[:0] for k, v in like.items()}
    return pad_rows(none, len(like["input_ids"]))


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """``model`` in eval mode (no dropout) for the block, its mode restored after."""
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)
