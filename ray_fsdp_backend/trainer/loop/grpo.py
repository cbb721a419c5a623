"""``train.objective: grpo``: the online-RL loop ``ray-fsdp train`` runs on every worker.

Each step, in order (docs/rl.md):

1. **Rollout** (rank 0): ``train.grpo.prompts_per_step`` prompts, drawn in a
   seeded order that a resume reproduces (:class:`PromptSampler`), go to the
   rollout engines (:class:`~ray_fsdp_backend.rl.fleet.RolloutFleet`, Ray
   actors rank 0 starts), ``group_size`` samples each.
2. **Reward** (Ray tasks): the ``reward:`` function scores the decoded
   responses with the prompt records' fields.
3. **Advantages and rows**: the samples and rewards are broadcast; every
   rank builds the same rows (:func:`~ray_fsdp_backend.rl.grpo.rollout_rows`,
   GRPO's group-normalised advantages) and keeps its data-parallel share.
4. **Policy update**: :func:`~ray_fsdp_backend.rl.grpo.policy_update`
   (``train.grpo.updates`` optimizer steps of the clipped loss, the KL to
   the base with ``kl_coef``: the LoRA model with its adapters disabled, or
   a frozen copy of the base in a full fine-tune).
5. **Weight sync**: :func:`~ray_fsdp_backend.rl.fleet.sync_weights` streams
   the new weights (HF names, buckets of ``rollout.bucket_bytes``; the LoRA
   adapters alone with ``rollout.sync: adapters``) to every engine through
   the object store.

With ``rollout.colocate`` the rollout (1 and 2) runs with the policy and
optimizer offloaded on every rank and the engines awake, the rest with the
policy onloaded and the engines asleep (:mod:`.colocation`).

An engine that Ray restarted after a crash comes back with the
checkpoint's weights: its weight version no longer matches, so the step
syncs again before sampling. A resumed run restores the policy, optimizer,
schedule, step and prompt position, and syncs before its first rollout.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import numpy as np
import torch

from ray_fsdp_backend.distributed.collectives import broadcast_from_rank0
from ray_fsdp_backend.distributed.seeding import seed_step
from ray_fsdp_backend.metrics.flops import format_progress
from ray_fsdp_backend.metrics.reporting import TensorBoardWriter
from ray_fsdp_backend.rl.fleet import RolloutFleet, StaleEngineError, SyncStats, sync_weights
from ray_fsdp_backend.rl.grpo import dp_share, policy_update, rollout_rows
from ray_fsdp_backend.trainer.loop.checkpoints import CheckpointHooks
from ray_fsdp_backend.trainer.loop.colocation import Colocation, engine_placement, trainer_nodes
from ray_fsdp_backend.trainer.loop.optim import build_optimizer, lr_factor
from ray_fsdp_backend.trainer.loop.pretrained import build_frozen_base, build_pretrained
from ray_fsdp_backend.trainer.schema.rl import prompt_options
from ray_fsdp_backend.trainer.schema.spec import RunSpec

_logger = logging.getLogger(__name__)
ROLLOUT_TRIES = 3
"""Rollouts tried per step when an engine answers stale (each after a sync)."""


class PromptSampler:
    """The prompts of each step: a seeded permutation of the prompt set per
    pass, ``per_step`` at a time; :meth:`state_dict` is the position, so a
    resume draws what the uninterrupted run would."""

    def __init__(self, count: int, per_step: int, seed: int) -> None:
        self.count, self.per_step, self.seed = count, per_step, seed
        self.position = 0

    def next(self) -> list[int]:
        """The next step's prompt indices (a pass's tail continues into the next pass)."""
        indices = [self._index(self.position + i) for i in range(self.per_step)]
        self.position += self.per_step
        return indices

    def _index(self, k: int) -> int:
        epoch, offset = divmod(k, self.count)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.count)
        return int(order[offset])

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def run_grpo(
    ctx,
    spec: RunSpec,
    *,
    report: Callable[[dict], None] | None = None,
    resume: bool = True,
) -> list[dict[str, float]]:
    """Set up the policy, the engines and the prompts, and run the loop of
    the module docstring to ``train.steps``; returns the logged history."""
    opts, rollout = spec.train, spec.rollout
    torch.manual_seed(opts.seed)
    model = build_pretrained(ctx, spec.model)
    # The KL's reference: the LoRA model with its adapters off, else a frozen copy.
    full_kl = opts.grpo.kl_coef and spec.model.lora is None
    reference = build_frozen_base(ctx, spec.model) if full_kl else None
    optimizer = build_optimizer(model, spec)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, opts))
    checkpoints = CheckpointHooks(
        ctx, every=opts.checkpoint_every, async_save=opts.checkpoint_async, report=report
    )
    colocation = Colocation(ctx, model, optimizer, reference, enabled=rollout.colocate)
    nodes = trainer_nodes() if rollout.colocate else None
    side = _RankZero(spec, nodes) if ctx.world_rank == 0 else None
    count = broadcast_from_rank0(lambda: len(side.prompts))
    sampler = PromptSampler(count, opts.grpo.prompts_per_step, opts.seed)
    extra = checkpoints.restore(model, optimizer, schedule, sampler) if resume else {}
    start_step = int(extra.get("step", 0))
    rows_per_step = opts.grpo.prompts_per_step * opts.grpo.group_size
    if rows_per_step % ctx.dp_size:
        raise ValueError(
            f"train.grpo.prompts_per_step x group_size = {rows_per_step} samples per step do "
            f"not split over {ctx.dp_size} data-parallel ranks"
        )
    meter = ctx.step_meter(
        model, seq_len=spec.model.seq_len, total_steps=opts.steps, start_step=start_step
    )
    board = (
        TensorBoardWriter(spec.logging.tensorboard) if side and spec.logging.tensorboard else None
    )
    history, synced = [], start_step == 0  # a resumed policy differs from the engines' checkpoint
    sync = None
    for step in range(start_step + 1, opts.steps + 1):
        seed_step(ctx, opts.seed, step)
        batch, sync = _rollout(ctx, model, side, sampler, spec, step, synced, sync, colocation)
        synced = True
        rows = dp_share(
            rollout_rows(*batch, spec.model.seq_len, opts.grpo), ctx.dp_rank, ctx.dp_size
        )
        if ctx.tp_rank == 0:
            meter.count_tokens(int((rows["targets"] != -100).sum()))
        update = policy_update(
            ctx, model, optimizer, rows, opts.grpo,
            micro_batch_size=opts.micro_batch_size, temperature=rollout.temperature,
            max_tokens=rollout.max_tokens, max_grad_norm=opts.max_grad_norm or None,
            chunk_tokens=opts.loss_chunk_tokens, reference=reference,
        )  # fmt: skip
        schedule.step()
        sync = _sync(ctx, model, side, spec.rollout, colocation)
        if (
            step % opts.log_every == 0
            or step in (start_step + 1, opts.steps)
            or checkpoints.due(step)
        ):
            metrics = _metrics(ctx, meter, step, batch, update, sync, schedule, sampler)
            metrics.update(colocation.metrics())
            history.append(metrics)
            if side:
                _logger.info(format_progress(metrics, opts.steps))
            if board is not None:
                board.write(metrics, step)
            state = {"step": step, "data": sampler.state_dict(), "schedule": schedule.state_dict()}
            checkpoints.report(step, model, optimizer, metrics, state)
    if board is not None:
        board.close()
    if spec.model.export:
        ctx.export_model(
            model, spec.model.export, format=spec.model.export_format,
            overwrite=spec.model.export_overwrite,
        )  # fmt: skip
    return history


class _RankZero:
    """What rank 0 alone holds: the prompts, the tokenizer, the engines."""

    def __init__(self, spec: RunSpec, nodes: list[str] | None) -> None:
        from ray_fsdp_backend.hf.metadata import load_tokenizer
        from ray_fsdp_backend.rl.prompts import read_prompts

        self.spec = spec
        self.tokenizer = load_tokenizer(spec.model.pretrained)
        self.prompts = read_prompts(
            spec.data.path, self.tokenizer, **prompt_options(spec.data, spec.model, spec.rollout)
        )
        self.fleet = RolloutFleet(start_engines(spec, nodes), transport=spec.rollout.transport)

    def sample(self, indices: list[int], step: int):
        """Prompts, samples and rewards of one step (None: an engine was stale)."""
        from ray_fsdp_backend.rl.rewards import score

        rollout, group = self.spec.rollout, self.spec.train.grpo.group_size
        prompts = [self.prompts.token_ids[i] for i in indices]
        try:
            samples = self.fleet.generate(
                prompts, n=group, max_tokens=rollout.max_tokens, temperature=rollout.temperature,
                top_p=rollout.top_p, seed=self.spec.train.seed * 1_000_003 + step * 1009,
            )  # fmt: skip
        except StaleEngineError as exc:
            _logger.warning("step %d: %s; syncing the weights again", step, exc)
            return None
        completions = [
            self.tokenizer.decode(s["token_ids"], skip_special_tokens=True)
            for group_samples in samples
            for s in group_samples
        ]
        repeat = [i for i in indices for _ in range(group)]
        fields = {k: [self.prompts.fields[i].get(k) for i in repeat] for k in self._field_names()}
        rewards = score(
            self.spec.reward.function, [self.prompts.prompts[i] for i in repeat], completions,
            fields, chunk=self.spec.reward.chunk,
        )  # fmt: skip
        return prompts, samples, torch.tensor(rewards)  # host: broadcast as objects

    def _field_names(self) -> list[str]:
        return sorted({k for f in self.prompts.fields for k in f})


def _rollout(ctx, model, side, sampler, spec, step, synced, last_sync, colocation):
    """One step's (prompts, samples, rewards) on every rank, syncing the
    engines first when they may be stale (collective)."""
    indices = sampler.next()
    sync = last_sync
    for _ in range(ROLLOUT_TRIES):
        stale = broadcast_from_rank0(lambda: side.fleet.stale()) or not synced
        if stale:
            sync = _sync(ctx, model, side, spec.rollout, colocation)
            synced = True
        with colocation.rollout_phase(side.fleet if side else None):
            # A reward function's error on rank 0 is raised on every rank.
            batch = broadcast_from_rank0(lambda: side.sample(indices, step))
        if batch is not None:
            return batch, sync
        synced = False
    raise RuntimeError(f"step {step}: the rollout engines stayed stale after {ROLLOUT_TRIES} syncs")


def _sync(ctx, model, side, rollout, colocation) -> SyncStats:
    """The policy's weights (or its adapters: ``rollout.sync``) to rank 0's
    engines (collective), the engines' weights awake for it when colocated."""
    fleet = side.fleet if side else None
    colocation.wake_weights(fleet)
    return sync_weights(
        ctx, model, fleet, bucket_bytes=rollout.bucket_bytes, adapters=rollout.sync == "adapters"
    )


def _metrics(ctx, meter, step, batch, update, sync, schedule, sampler) -> dict[str, float]:
    _, samples, rewards = batch
    counts = [len(s["token_ids"]) for group in samples for s in group]
    lengths = torch.tensor(counts, dtype=torch.float64)  # host: metrics of host samples
    same = {
        "reward/mean": rewards.mean(),
        "reward/std": rewards.std() if len(rewards) > 1 else torch.zeros(()),  # host: metric
        "response_length": lengths.mean(),
        "grad_norm": update["grad_norm"],
        "clip_fraction": update["clip_fraction"],
        "kl": update["kl"],
        "log_prob_gap": update["log_prob_gap"],
        "entropy": update["entropy"],
        "skipped_steps": update["skipped"],
    }
    metrics = {"step": step, **meter.measure(step, mean={"loss": update["loss"]}, same=same)}
    metrics.update(
        lr=schedule.get_last_lr()[0],
        data_position=sampler.position,
        world_size=ctx.world_size,
        sync_s=sync.seconds if sync else 0.0,
        sync_bytes=float(sync.bytes if sync else 0),
    )
    return metrics


def start_engines(spec: RunSpec, nodes: list[str] | None = None) -> list:
    """The run's rollout engine actors (restarted by Ray if they die): on
    the trainer's ``nodes`` when given (a colocated run); with
    ``rollout.sync: adapters`` each built with the run's LoRA config, to
    apply the adapters a sync sends to the checkpoint's base."""
    import ray

    rollout = spec.rollout
    # Restarted after a crash, its calls in flight retried (each is idempotent:
    # a seeded generate, a bucket load); a restarted engine holds the
    # checkpoint's weights, which its version tells the loop.
    options = dict(
        num_cpus=rollout.num_cpus, num_gpus=rollout.num_gpus, max_restarts=-1, max_task_retries=-1
    )
    if rollout.engine == "vllm":
        from ray_fsdp_backend.rl import rollout_vllm as module
    else:
        from ray_fsdp_backend.rl import rollout_hf as module
    if rollout.python is not None:
        options["runtime_env"] = engine_environment(module, rollout.python)
    engine_class = module.VLLMRollout if rollout.engine == "vllm" else module.HFRollout
    engine = ray.remote(engine_class)
    run = uuid.uuid4().hex[:8]
    kwargs = {"dtype": rollout.dtype}
    if rollout.sync == "adapters":
        kwargs["lora"] = spec.model.lora.peft_kwargs()
    if rollout.engine == "hf" and rollout.num_gpus > 0:
        kwargs["device"] = "cuda"  # Ray set the actor's CUDA_VISIBLE_DEVICES
    if rollout.engine == "vllm" and rollout.colocate and rollout.num_gpus > 0:
        kwargs["sleep_mode"] = True  # vLLM's sleep mode exists on GPUs only
    return [
        engine.options(
            name=f"rfb-rollout-{run}-{i}", **options, **engine_placement(nodes, i)
        ).remote(spec.model.pretrained, **kwargs)
        for i in range(rollout.replicas)
    ]


def engine_environment(module, python: str) -> dict:
    """The runtime environment of an engine actor in another Python
    environment: its interpreter, and the engine's module sent by value
    (it imports nothing of this package, which need not be installed there)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return {"py_executable": python}
