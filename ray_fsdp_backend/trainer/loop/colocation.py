"""``rollout.colocate: true``: the trainer and the rollout engines share the devices in turn.

Each step of the GRPO loop (:mod:`.grpo`) has a rollout phase (generation
and reward) and a training phase (log-probs, the update, the weight sync).
Colocated, :meth:`Colocation.rollout_phase` wraps the first: every trainer
rank offloads its policy, optimizer and any frozen reference (``ctx.offload``: parameters,
gradients, buffers and optimizer state to host memory, bit-exact) and the
ranks agree on it before rank 0 wakes the engines; after the rollout rank 0
puts the engines to sleep and every rank onloads. Before each weight sync
:meth:`Colocation.wake_weights` wakes the engines' weights only (vLLM's
``wake_up(tags=["weights"])``), so the sync writes device memory while their
KV cache stays released, as verl orders it. The engines' ``sleep`` /
``wake_up`` release and take back their own memory (vLLM's sleep mode on
GPU; no-ops on CPU: :mod:`~ray_fsdp_backend.rl.rollout_hf`,
:mod:`~ray_fsdp_backend.rl.rollout_vllm`).

:func:`engine_placement` puts a colocated run's engines on the trainer's
nodes (Ray's node affinity, round-robin over the nodes the ranks run on).
Separate (``colocate: false``), every method here does nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch.distributed as dist

from ray_fsdp_backend.distributed.collectives import agreed


class Colocation:
    """The offload / onload and sleep / wake of one run's colocated phases
    (every call a no-op when ``enabled`` is False); ``offload_s`` and
    ``onload_s`` are this rank's seconds of the last rollout phase."""

    def __init__(self, ctx, model, optimizer, reference=None, *, enabled: bool) -> None:
        self.ctx, self.model, self.optimizer, self.enabled = ctx, model, optimizer, enabled
        self.reference = reference
        """A frozen KL reference, offloaded with the policy (None: none)."""
        self.offload_s = self.onload_s = 0.0

    @contextlib.contextmanager
    def rollout_phase(self, fleet) -> Iterator[None]:
        """Around a rollout (collective): offload on every rank, the engines
        of ``fleet`` (rank 0's; None elsewhere) awake for it and asleep
        after it, then onload on every rank."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        with agreed("offloading the policy for the rollout"):
            self.ctx.offload(self.model, self.optimizer)
            if self.reference is not None:
                self.ctx.offload(self.reference)
        self.offload_s = time.perf_counter() - start
        _call_engines(fleet, "wake_up", None)
        yield
        _call_engines(fleet, "sleep")
        start = time.perf_counter()
        self.ctx.onload(self.model, self.optimizer)
        if self.reference is not None:
            self.ctx.onload(self.reference)
        self.onload_s = time.perf_counter() - start

    def wake_weights(self, fleet) -> None:
        """Before a weight sync: the engines' weights awake, their KV cache not."""
        if self.enabled:
            _call_engines(fleet, "wake_up", ["weights"])

    def metrics(self) -> dict[str, float]:
        """``offload_s`` and ``onload_s`` of the last rollout phase (none when separate)."""
        return {"offload_s": self.offload_s, "onload_s": self.onload_s} if self.enabled else {}


def _call_engines(fleet, method: str, *args) -> None:
    """``method(*args)`` on every engine of ``fleet``, waited for (None: not rank 0)."""
    if fleet is None:
        return
    import ray

    ray.get([getattr(engine, method).remote(*args) for engine in fleet.engines])


def trainer_nodes() -> list[str]:
    """The Ray node ids the trainer's ranks run on, in rank order, each once
    (collective: every rank calls it)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    nodes = [node]
    if dist.is_initialized() and dist.get_world_size() > 1:
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node)
    return list(dict.fromkeys(nodes))


def engine_placement(nodes: list[str] | None, index: int) -> dict:
    """Ray actor options that put engine ``index`` on one of the trainer's
    ``nodes`` (round-robin; hard affinity, so an engine never lands on a node
    without a trainer rank); None: a separate run's engines go anywhere."""
    if not nodes:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = nodes[index % len(nodes)]
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
