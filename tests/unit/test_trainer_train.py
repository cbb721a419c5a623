"""The example train loop's pieces in one process: schedule, steps, checkpoint hooks."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from ray_fsdp_backend.cli.main import merge_history
from ray_fsdp_backend.context_parallel import shard_sequence
from ray_fsdp_backend.distributed.clip import clip_grad_norm_
from ray_fsdp_backend.models.decoder import Transformer
from ray_fsdp_backend.trainer.data.corpus import ShardedBatches, load_corpus
from ray_fsdp_backend.trainer.loop import train
from ray_fsdp_backend.trainer.schema.spec import TrainOptions, load_spec

CPU_TINY = Path(__file__).resolve().parents[2] / "examples" / "cpu_tiny.yaml"


class FakeContext:
    """The parts of TrainContext the loop uses, for one process without a backend."""

    def __init__(self):
        self.device, self.world_rank, self.no_sync_calls = torch.device("cpu"), 0, 0
        self.strategy = type("S", (), {"params_sharded": True})()
        self.config = None

    @contextlib.contextmanager
    def no_sync(self, model):
        self.no_sync_calls += 1
        yield

    cp_size = tp_size = pp_size = 1
    dp_rank = cp_rank = tp_rank = pp_rank = 0

    def global_token_count(self, labels):
        return sum((part != -100).sum() for part in labels).float()  # one rank: the step's count

    def clip_grad_norm(self, model, max_norm, optimizer=None):
        return clip_grad_norm_(model.parameters(), max_norm).total_norm  # the strategies' clip

    def shard_sequence(self, batch):
        return shard_sequence(batch, 0, 1)  # one cp rank: the whole rows

    def sequence_region(self):
        return contextlib.nullcontext()

    def loss_parallel(self):
        return contextlib.nullcontext()


def test_lr_warms_up_linearly_then_decays_to_the_floor():
    opts = TrainOptions(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert train.lr_factor(0, opts) == pytest.approx(0.1)
    assert train.lr_factor(9, opts) == pytest.approx(1.0)
    assert train.lr_factor(10, opts) == pytest.approx(1.0)
    assert train.lr_factor(55, opts) == pytest.approx(0.55)
    assert train.lr_factor(100, opts) == pytest.approx(0.1)
    factors = [train.lr_factor(s, opts) for s in range(10, 101)]
    assert factors == sorted(factors, reverse=True)


def test_train_step_accumulates_under_no_sync_and_lowers_the_loss():
    small = ["model.dim=64", "model.n_layers=2", "model.seq_len=64"]
    spec = load_spec(CPU_TINY, [*small, "train.grad_accum=2", "train.micro_batch_size=4"])
    torch.manual_seed(0)
    ctx, model = FakeContext(), Transformer(spec.model)
    optimizer = train.build_optimizer(model, spec)
    batches = ShardedBatches(load_corpus(), spec.model.seq_len, 4, 0, 1)
    losses = [train.train_step(ctx, model, optimizer, batches, spec).loss for _ in range(15)]
    losses = torch.stack(losses).tolist()
    assert ctx.no_sync_calls == 15  # one of the two micro-batches per step
    assert batches.position == 15 * 2 * 4
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0


def _one_step(overrides, poison_grads=False):
    small = ["model.dim=32", "model.n_layers=1", "model.seq_len=32", *overrides]
    spec = load_spec(CPU_TINY, small)
    torch.manual_seed(0)
    ctx, model = FakeContext(), Transformer(spec.model)
    if poison_grads:
        for p in model.parameters():
            p.register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = train.build_optimizer(model, spec)
    batches = ShardedBatches(load_corpus(), spec.model.seq_len, 2, 0, 1)
    result = train.train_step(ctx, model, optimizer, batches, spec)
    moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    return result, moved, optimizer


@pytest.mark.parametrize("value", ["0", "null"])
def test_max_grad_norm_zero_or_null_means_no_clipping(value):
    result, moved, _ = _one_step([f"train.max_grad_norm={value}"])
    norm = result.grad_norm
    assert torch.isfinite(norm) and norm > 1.0 and moved  # measured, unclipped, stepped
    assert result.skipped == 0


def test_non_finite_norm_skips_the_step_on_the_device():
    result, moved, optimizer = _one_step([], poison_grads=True)
    assert not torch.isfinite(result.grad_norm) and result.skipped == 1 and not moved
    # found_inf: the fused AdamW left its moments at zero and its step count at 0.
    assert all(s["step"] == 0 and not s["exp_avg"].any() for s in optimizer.state.values())


def test_adamw_decays_only_matrices():
    spec = load_spec(CPU_TINY)
    groups = train.build_optimizer(Transformer(spec.model), spec).param_groups
    assert all(p.ndim == 2 for p in groups[0]["params"]) and groups[0]["weight_decay"] > 0
    assert all(p.ndim == 1 for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0


def test_logged_steps_never_report_to_ray(monkeypatch):
    """``ray.train.report`` (a barrier that can wait 2 s for Ray's controller)
    never runs at a logged step without a checkpoint."""

    class Ctx(FakeContext):
        def save_checkpoint(self, *args, **kwargs):
            raise AssertionError("checkpoint_every 0 saved a checkpoint")

    reports = []
    monkeypatch.setattr(train.ray.train, "report", lambda metrics: reports.append(metrics))
    hooks = train.CheckpointHooks(Ctx(), every=0)
    assert not hooks.due(10)
    for step in (10, 11, 12):
        hooks.report(step, None, None, {"step": step}, {"step": step})
    assert reports == []
    own = []
    train.CheckpointHooks(Ctx(), every=0, report=own.append).report(11, None, None, {}, {})
    assert own == [{}] and reports == []  # a given reporter gets the metrics


def test_checkpoint_hooks_save_when_due_and_restore_position():
    class Ctx(FakeContext):
        saved = []

        def save_checkpoint(self, model, optimizer, metrics, *, extra_state, async_save=False):
            self.saved.append(extra_state)

        def restore_checkpoint(self, model, optimizer):
            return self.saved[-1] if self.saved else None

    ctx = Ctx()
    hooks = train.CheckpointHooks(ctx, every=5)
    batches = ShardedBatches(load_corpus(), 32, 2, 0, 1, position=40)
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1), lambda s: 1)
    state = {"step": 5, "data": batches.state_dict(), "schedule": sched.state_dict()}
    hooks.report(5, None, None, {}, state)
    assert ctx.saved == [state] and hooks.due(5) and not hooks.due(6)
    fresh = ShardedBatches(load_corpus(), 32, 2, 0, 1)
    assert hooks.restore(None, None, sched, fresh) == state
    assert fresh.position == 40


def test_resumed_history():
    # The progress line is tested in test_metrics.py.
    old = [{"step": s} for s in (1, 10, 20, 30)]
    assert merge_history(old, [{"step": 21}, {"step": 30}]) == [
        {"step": 1}, {"step": 10}, {"step": 20}, {"step": 21}, {"step": 30}
    ]  # fmt: skip
    assert not math.isnan(train.lr_factor(0, TrainOptions(steps=1, warmup_steps=0)))
