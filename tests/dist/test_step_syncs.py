"""The real training loop (``run_training``, what ``ray-fsdp train`` runs) on
2 gloo ranks: no host sync in a step that does not log (FSDP2 accumulating
unsharded, HSDP deferring its all-reduce, DMuon, DDP), a non-finite step
skipped on the device, and the same losses as one process on the same data.

One spawned job runs every case. Host syncs are counted with the profiler:
every ``aten::_local_scalar_dense`` (what ``.item()``, ``float()``,
``int()`` and ``bool()`` of a tensor run, also inside torch and under
DTensor) that starts within a non-logged step's span, except those the CPU
fused AdamW kernel makes (see ``CPU_KERNEL_READS``). Steps 2-4 and 6 do not log
(``log_every: 5``); step 3 is poisoned (every gradient times inf) and must
be skipped without a sync. Packed rows read their document spans once per
micro-batch's forward, whatever the layer count. (Compiled blocks:
tests/dist/test_compile.py.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.dist.harness import run_ranks

CPU_TINY = Path(__file__).resolve().parents[2] / "examples" / "cpu_tiny.yaml"
STEPS, LOG_EVERY, POISONED = 7, 5, 3
SMALL = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
    f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.warmup_steps=2",
]  # fmt: skip
POISONED_CASES = {
    "fsdp_accumulate": ["train.grad_accum=2", "train.micro_batch_size=2",
                        "distributed.fsdp_accumulate_unsharded=true"],
    "hsdp_accumulate": ["train.grad_accum=2", "train.micro_batch_size=2",
                        "distributed.fsdp_sharding_strategy=hybrid_shard",
                        "distributed.fsdp_hsdp_replicate_size=2"],
    "dmuon": ["train.optimizer=muon", "train.lr=0.02", "distributed.use_dmuon=true",
              "train.micro_batch_size=2"],
}  # fmt: skip
# Packed rows read their document spans to the host once per forward (a
# nonzero, whose output size a device must send to the host; on CPU the
# profiler shows it as aten::nonzero, not as a scalar read), not once per
# layer: one per micro-batch.
PACKED = ["data.packing=true", "train.grad_accum=2", "train.micro_batch_size=2"]
SPAN_READS_PER_STEP = 2
# DDP initialises the whole model from the seed on every rank, as one process
# does (FSDP2 initialises its shards, which differ by world size on CPU).
DDP = ["distributed.use_fsdp=false", "train.grad_accum=2"]
NON_LOGGED = [s for s in range(2, STEPS) if s % LOG_EVERY]
# The CPU kernel of fused AdamW reads each step counter (a CPU tensor) with
# item() inside the kernel; the CUDA kernel reads them on the device. So does
# torch._assert_async (the chunked loss's label check): an item() on CPU, a
# device-side assert on CUDA. Not host syncs on a GPU, so not counted (every
# other read is).
CPU_KERNEL_READS = ("aten::_fused_adamw_", "aten::_assert_async")


def _inside(event, names: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


class _ProbedContext:
    """The real context; it keeps the wrapped model and, with ``poison``,
    multiplies every gradient by inf before the clip of step ``POISONED``
    (the clip then sees a non-finite norm)."""

    def __init__(self, ctx, poison: bool):
        self._ctx, self.poison, self.step, self.model = ctx, poison, 0, None

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def wrap(self, model):
        self.model = self._ctx.wrap(model)
        return self.model

    def clip_grad_norm(self, model, max_norm, *, optimizer=None):
        if self.poison and self.step == POISONED:
            for p in model.parameters():
                p.grad.mul_(float("inf"))
        return self._ctx.clip_grad_norm(model, max_norm, optimizer=optimizer)


def _train(overrides: list[str], *, poison: bool) -> dict:
    from ray_fsdp_backend.runtime.worker import setup_process_context
    from ray_fsdp_backend.trainer.loop.train import run_training
    from ray_fsdp_backend.trainer.schema.spec import load_spec

    spec = load_spec(CPU_TINY, [*SMALL, *overrides])
    ctx = setup_process_context(spec.distributed, torch.device("cpu"))
    wrapped = _ProbedContext(ctx, poison)
    spans, params = {}, {}

    def open_span(step: int) -> None:
        wrapped.step = step
        spans[step] = torch.profiler.record_function(f"step_{step}")
        spans[step].__enter__()

    def on_step(step: int) -> None:
        spans[step].__exit__(None, None, None)
        params[step] = [_full(p) for p in wrapped.model.parameters()]
        open_span(step + 1)

    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        open_span(0)  # the probe: one read the counter must see
        float(torch.zeros(()))
        spans[0].__exit__(None, None, None)
        open_span(1)
        history = run_training(wrapped, spec, report=lambda m: None, on_step=on_step, resume=False)
        spans[STEPS + 1].__exit__(None, None, None)
    events = prof.events()
    windows = {int(e.name[5:]): e.time_range for e in events if e.name.startswith("step_")}
    syncs = _per_step(events, windows, "aten::_local_scalar_dense")
    skipped_unchanged = all(
        torch.equal(a, b) for a, b in zip(params[POISONED - 1], params[POISONED], strict=True)
    )
    return {
        "syncs": syncs,
        "span_reads": _per_step(events, windows, "aten::nonzero"),
        "history": history,
        "skipped_unchanged": skipped_unchanged,
    }


def _per_step(events, windows: dict, name: str) -> dict[int, int]:
    """How many ``name`` ops start in each step's window (the fused AdamW
    kernel's own reads left out)."""
    counts = {s: 0 for s in windows}
    for e in events:
        if e.name == name and not _inside(e, CPU_KERNEL_READS):
            step = next((s for s, w in windows.items() if w.start <= e.time_range.start <= w.end))
            counts[step] += 1
    return counts


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _ranks(rank: int, world: int) -> dict:
    out = {name: _train(over, poison=True) for name, over in POISONED_CASES.items()}
    out["packed"] = _train(PACKED, poison=False)
    return out | {"ddp": _train([*DDP, "train.micro_batch_size=2"], poison=False)}


def _single(rank: int, world: int) -> list[dict]:
    return _train([*DDP, "train.micro_batch_size=4"], poison=False)["history"]


def test_the_loop_never_syncs_outside_logged_steps_and_matches_one_process():
    got = run_ranks(_ranks, 2)
    for name, case in got.items():
        assert [m["step"] for m in case["history"]] == [1, 5, 7], name
        non_logged = {s: case["syncs"][s] for s in NON_LOGGED}
        assert non_logged == {s: 0 for s in NON_LOGGED}, (name, case["syncs"])
        assert case["syncs"][0] == 1, name  # the probe's float(tensor) is counted
    span_reads = {s: got["packed"]["span_reads"][s] for s in NON_LOGGED}
    assert span_reads == {s: SPAN_READS_PER_STEP for s in NON_LOGGED}, got["packed"]["span_reads"]
    for name in POISONED_CASES:
        case = got[name]
        assert case["skipped_unchanged"], name  # parameters as before the poisoned step
        assert [m["skipped_steps"] for m in case["history"]] == [0, 1, 1], name
        assert all(torch.isfinite(torch.tensor(m["loss"])) for m in case["history"]), name
    # DDP, 2 ranks x 2 rows x 2 micro-batches = 1 process x 4 rows x 2: the same
    # global batches, the same losses and norms.
    reference = run_ranks(_single, 1)
    for key in ("loss", "grad_norm"):
        got_values = [m[key] for m in got["ddp"]["history"]]
        torch.testing.assert_close(got_values, [m[key] for m in reference], rtol=1e-5, atol=1e-6)
    assert [m["skipped_steps"] for m in got["ddp"]["history"]] == [0, 0, 0]
