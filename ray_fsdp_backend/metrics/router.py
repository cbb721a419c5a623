"""Router statistics of a mixture-of-experts model: how evenly each MoE
layer's router spreads tokens over its experts.

:class:`RouterStats` hooks every router (:func:`find_routers`: Qwen's and
Mixtral's ``mlp.gate``, gpt-oss's ``mlp.router``, whose output is
transformers' ``(router_logits, top_k_weights, top_k_index)``) and counts,
on the device, the (token, expert) pairs each expert is picked for: no host
sync between logging steps. :meth:`RouterStats.collect`, called on logging
steps only, sums the counts over all ranks (the global batch: every rank
routes its own tokens) and returns each layer's load imbalance, the busiest
expert's count over the mean count (1.0: perfectly even; with E experts at
most E). A ratio is kept rather than raw counts because a forward that runs
twice (activation checkpointing recomputes it in backward) doubles every
count alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

import torch
import torch.distributed as dist
from torch import nn

from ray_fsdp_backend.compat.transformers_moe import router_class
from ray_fsdp_backend.strategies.expert_parallel import experts_modules

_LAYER = re.compile(r"layers\.(\d+)\.")
_PAUSED = contextvars.ContextVar("rfb_router_counting_paused", default=False)


@contextlib.contextmanager
def uncounted():
    """Routing inside the block is not counted: torch's pipeline stage runs
    one extra forward on its first step to infer shapes (the first stage on
    the real micro-batch, the others on uninitialised stand-ins)."""
    token = _PAUSED.set(True)
    try:
        yield
    finally:
        _PAUSED.reset(token)


class RouterStats:
    """Per-layer expert load of ``model``'s routers since the last
    :meth:`collect` (see the module docstring). Build it once after
    ``ctx.wrap``; :meth:`close` removes the hooks."""

    def __init__(self, model: nn.Module, stages: bool = False):
        """``stages``: ``model`` is one pipeline stage (each rank counts only
        its stage's layers; :meth:`collect` then sums per layer label)."""
        self._stages = stages
        self._counts: dict[str, torch.Tensor] = {}
        self._handles = [
            module.register_forward_hook(self._counter(_label(name)))
            for name, module in find_routers(model)
        ]

    def _counter(self, label: str):
        def hook(module, inputs, output) -> None:
            if _PAUSED.get():
                return
            logits, _, index = output
            # index_add_, not bincount: CUDA's bincount reads the largest id to the host.
            flat = index.detach().flatten()
            counts = torch.zeros(logits.shape[-1], dtype=torch.long, device=flat.device)
            counts.index_add_(0, flat, torch.ones_like(flat))
            previous = self._counts.get(label)
            self._counts[label] = counts if previous is None else previous + counts

        return hook

    def collect(self) -> dict[str, float]:
        """``{"router/layer{i}/max_over_mean": ratio}`` over the global batch
        since the last call, then start counting afresh. Collective when a
        process group is initialised (one all-reduce, one host sync); every
        rank must call it at the same step. Empty when nothing was routed."""
        if self._stages and dist.is_initialized():
            return self._collect_stages()
        if not self._counts:
            return {}
        labels = sorted(self._counts, key=_order)
        counts = torch.stack([self._counts[label] for label in labels]).double()
        self._counts.clear()
        if dist.is_initialized():
            dist.all_reduce(counts)
        return _ratios(labels, counts)

    def _collect_stages(self) -> dict[str, float]:
        """:meth:`collect` under pipeline parallelism: the stages hold
        different layers (a stage may hold no router), so every rank sends
        its per-layer counts to all (one ``all_gather_object``) and each
        layer's counts are summed over the ranks that hold it."""
        local = {label: counts.tolist() for label, counts in self._counts.items()}
        self._counts.clear()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        totals: dict[str, torch.Tensor] = {}
        for part in gathered:
            for label, counts in part.items():
                add = torch.tensor(counts, dtype=torch.float64)  # host: gathered lists
                totals[label] = totals[label] + add if label in totals else add
        if not totals:
            return {}
        labels = sorted(totals, key=_order)
        return _ratios(labels, torch.stack([totals[label] for label in labels]))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def find_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each MoE layer's router, found by the family's own
    tables: in the block holding each experts module of the model's
    expert-parallel plan (``base_model_ep_plan``), the child of the class
    transformers records router logits from. Empty for a dense model."""
    cls = router_class(model)
    if cls is None:
        return []
    routers = []
    for experts in experts_modules(model):
        block = experts.rpartition(".")[0]
        for child, module in model.get_submodule(block).named_children():
            if isinstance(module, cls):
                routers.append((f"{block}.{child}", module))
    return routers


def _order(label: str) -> int:
    return int(label) if label.isdigit() else -1


def _ratios(labels: list[str], counts: torch.Tensor) -> dict[str, float]:
    """Each layer's busiest expert's count over the mean count."""
    ratios = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
    return {
        f"router/layer{label}/max_over_mean": r
        for label, r in zip(labels, ratios.tolist(), strict=True)
    }


def _label(name: str) -> str:
    match = _LAYER.search(name)
    return match.group(1) if match else name
