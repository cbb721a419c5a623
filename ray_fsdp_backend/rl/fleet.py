"""The rollout engines of a run, as the trainer's rank 0 drives them: sampling and weight sync.

:class:`RolloutFleet` holds the engines' actor handles (:mod:`.rollout_hf`,
:mod:`.rollout_vllm`: the same four methods). :meth:`~RolloutFleet.generate`
deals the prompts out in contiguous blocks, one per engine, and checks that
every engine answered with the weights of the last sync: an engine Ray
restarted after a crash (``max_restarts``) comes back with the checkpoint's
weights, so the fleet reports it stale and the loop syncs again before
sampling. :func:`sync_weights` is collective: every trainer rank iterates
``ctx.stream_weights`` (each bucket is gathered from the shards), and rank
0 hands each bucket to the fleet's transport (:mod:`.transport`): Ray's
object store (``rollout.transport: object_store``, any hardware and node)
or a process group of rank 0 and the engines (``collective``: gloo, or
NCCL on GPUs). At most two buckets are in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ray_fsdp_backend.distributed.collectives import agreed
from ray_fsdp_backend.rl.transport import build_transport


@dataclass
class SyncStats:
    seconds: float
    bytes: int


class StaleEngineError(RuntimeError):
    """An engine answered with weights older than the last sync (restarted)."""


class RolloutFleet:
    """Rollout engine actors (all with :class:`~.rollout_hf.HFRollout`'s
    methods); ``transport`` is how weight syncs reach them
    (:func:`~.transport.build_transport`: ``object_store`` | ``collective``)."""

    def __init__(self, engines: list, *, transport: str = "object_store") -> None:
        if not engines:
            raise ValueError("a rollout fleet needs at least one engine")
        self.engines = list(engines)
        self.transport = build_transport(transport, self.engines)
        self.version = 0
        """Syncs done since the engines were created (an engine's own count)."""

    def stale(self) -> bool:
        """Whether any engine holds other weights than the last sync's."""
        import ray

        versions = ray.get([engine.get_version.remote() for engine in self.engines])
        return any(v != self.version for v in versions)

    def generate(self, prompts: list[list[int]], *, seed: int, **sampling) -> list[list[dict]]:
        """Samples for ``prompts`` (per prompt a list, as the engines give
        them), each engine a contiguous block of prompts, its own seed.

        Raises:
            StaleEngineError: an engine answered with stale weights."""
        import ray

        per = -(-len(prompts) // len(self.engines))
        calls = [
            engine.generate.remote(prompts[i * per : (i + 1) * per], seed=seed + i, **sampling)
            for i, engine in enumerate(self.engines)
            if prompts[i * per : (i + 1) * per]
        ]
        samples = []
        for out in ray.get(calls):
            if out["version"] != self.version:
                raise StaleEngineError(
                    f"a rollout engine answered with weight version {out['version']}, "
                    f"not {self.version} (restarted?)"
                )
            samples.extend(out["samples"])
        return samples


def sync_weights(
    ctx, model, fleet: RolloutFleet | None, *, bucket_bytes, adapters: bool = False
) -> SyncStats:
    """Send ``model``'s weights to every engine of ``fleet`` (rank 0's;
    None on the other ranks): the whole model, LoRA merged, or with
    ``adapters`` the LoRA adapters alone (``ctx.stream_weights``' two
    streams; the engines were built for the one they get). Collective: a
    failure on rank 0 (an engine that cannot load) raises on every rank at
    that bucket's agreement
    (:func:`~ray_fsdp_backend.distributed.collectives.agreed`). Returns the
    seconds and the bytes sent to each engine (every rank receives every
    bucket, so every rank counts them alike)."""
    import ray

    start, sent = time.perf_counter(), 0
    for bucket in ctx.stream_weights(model, bucket_bytes=bucket_bytes, adapters=adapters):
        sent += sum(t.nbytes for _, t in bucket)
        with agreed("sending a weight bucket to the rollout engines"):
            if fleet is not None:
                fleet.transport.put(bucket)
        del bucket  # else the loop variable keeps it alive while the next one fills
    with agreed("finishing the rollout engines' weight sync"):
        if fleet is not None:
            fleet.transport.finish()
            fleet.version += 1
            ray.get([engine.finish_sync.remote(fleet.version) for engine in fleet.engines])
    return SyncStats(time.perf_counter() - start, sent)
