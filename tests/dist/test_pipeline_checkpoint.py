"""DCP checkpoints of a pipeline run reshard across pp sizes (issue 47).

One spawned job on 4 gloo ranks. The built-in decoder and a tiny
transformers Llama (4 layers: stages of 2) train 2 AdamW steps
at ``pp 2 x dp_shard 2`` and save model and optimizer state with
``save_sharded``; the run then takes its third step (the uninterrupted run).
The checkpoint is restored into fresh models at ``pp 1 x dp_shard 4``, at
``pp 2 x dp_shard 2`` and at ``pp 2 x dp_shard 2`` with 2 virtual stages per
rank under interleaved 1F1B (stages of 1 layer: rank 0 holds layers 0 and 2)
(new meshes in the same job), and each restored run's
next two steps equal the uninterrupted run's (loss and pre-clip norm, 1e-5;
the first also one process's third step). The saved learning rate differs
from the restored optimizers' own, so the second step shows the param groups
came back on every stage.
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ray_fsdp_backend.checkpoint import CheckpointStore, find_latest, load_sharded, save_sharded
from ray_fsdp_backend.planning.pipeline_traffic import padded_numel, stage_volumes
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks
from tests.dist.test_pipeline import MAX_NORM, ROWS, SEQ, _batch, _logits, _model, _reference

FAMILIES = ("decoder", "llama")
LAYOUTS = ("pp1_dp4", "pp2_dp2", "pp2v2_dp2")


def _context(pp: int, virtual: int = 1):
    settings = FSDPSettings(
        use_fsdp=True,
        use_mixed_precision=False,
        pipeline_parallel_size=pp,
        pipeline_schedule="1f1b" if virtual == 1 else "interleaved_1f1b",
        pipeline_virtual_stages=virtual,
        pipeline_microbatches=2 if pp > 1 else None,
    )
    return setup_process_context(settings, torch.device("cpu"))


def _wrapped(full, pp: int, virtual: int = 1):
    ctx = _context(pp, virtual)
    model = ctx.wrap(copy.deepcopy(full))
    return ctx, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(ctx, model, opt) -> tuple[float, float]:
    """One step on this dp rank's rows; the step's mean loss and pre-clip norm."""
    rows = ROWS // ctx.dp_size
    mine = {k: v[ctx.dp_rank * rows : (ctx.dp_rank + 1) * rows] for k, v in _batch().items()}
    opt.zero_grad()
    if ctx.pp_size > 1:
        loss = ctx.pipeline_step(model, mine)
    else:
        labels = ctx.shard_sequence({"labels": mine["labels"]})["labels"]
        logits = _logits(model, mine["input_ids"])
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        ) / ctx.global_token_count(labels)
        loss.backward()
    norm = ctx.clip_grad_norm(model, MAX_NORM)
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size(), float(norm)


def _family(family: str, root: str) -> dict:
    full = _model(family, 4)
    ref_losses, ref_norms, _ = _reference(copy.deepcopy(full))
    store = CheckpointStore.local(os.path.join(root, family))
    ctx, model, opt = _wrapped(full, 2)
    for _ in range(2):
        _step(ctx, model, opt)
    for group in opt.param_groups:  # as a schedule would: the restored runs must read it
        group["lr"] = 5e-3
    save_sharded(store, model, opt, extra_state={"step": 2})
    out = {
        "reference": (ref_losses[2], ref_norms[2]),
        "uninterrupted": [_step(ctx, model, opt) for _ in range(2)],
    }
    for layout in LAYOUTS:
        # Restored into a model initialised differently: every value must come from the checkpoint.
        fresh = copy.deepcopy(full)
        with torch.no_grad():
            for p in fresh.parameters():
                p.mul_(0.5)
        ctx, model, opt = _wrapped(fresh, int(layout[2]), 2 if "v2" in layout else 1)
        extra = load_sharded(store, find_latest(store), model, opt)
        out[layout] = [_step(ctx, model, opt) for _ in range(2)]
        out[f"{layout} extra"] = extra
    return out


class _CommCounter(TorchDispatchMode):
    """Bytes of the c10d ops a step dispatches, by kind: what a rank sends
    point to point, the all-gathers' outputs, the reduce-scatters' inputs
    (the largest tensor of each op). Observes the dispatcher, as torch's
    ``CommDebugMode`` does; patches nothing."""

    KINDS = {"send": "sends", "allgather": "all_gather", "reduce_scatter": "reduce_scatter"}

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter = Counter()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ops[func.__name__] += 1
            sizes = [t.numel() * t.element_size() for t in _tensors(args)]
            for word, kind in self.KINDS.items():
                if word in func.__name__ and sizes:
                    self.bytes[kind] += max(sizes)
        return func(*args, **(kwargs or {}))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _traffic() -> dict:
    """One pp 2 x dp 2 step of the decoder counted against the plan's volumes."""
    full = _model("decoder")
    dim = full.tok_embeddings.embedding_dim
    ctx, model, _ = _wrapped(full, 2)
    rows = ROWS // ctx.dp_size
    mine = {k: v[ctx.dp_rank * rows : (ctx.dp_rank + 1) * rows] for k, v in _batch().items()}
    ctx.pipeline_step(model, mine)  # the first step also sends shapes
    counter = _CommCounter()
    with counter:
        ctx.pipeline_step(model, mine)
    numels = [padded_numel(tuple(p.shape), ctx.dp_size) for p in model.parameters()]
    want = stage_volumes(
        numels,
        stage=ctx.pp_rank,
        stages=ctx.pp_size,
        activation_values=rows * SEQ * dim,
        param_bytes=4,
        reduce_bytes=4,
        activation_bytes=4,
    )
    return {"counted": dict(counter.bytes), "ops": dict(counter.ops), "formula": want}


def _checks(rank, world, root):
    results = {family: _family(family, root) for family in FAMILIES}
    results["traffic"] = _traffic()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    return gathered


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_checks, 4, str(tmp_path_factory.mktemp("pp_ckpt")), timeout_s=300)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_restored_step_equals_the_uninterrupted_run(results, family, layout):
    for rank, per_rank in enumerate(results):
        got = per_rank[family]
        assert got[f"{layout} extra"] == {"step": 2}, rank
        pairs = [(got[layout][0], got["reference"])]
        pairs += list(zip(got[layout], got["uninterrupted"], strict=True))
        for restored, want in pairs:
            for value, expected in zip(restored, want, strict=True):
                assert abs(value - expected) / expected < 1e-5, (rank, got[layout], want)


def test_one_steps_sends_and_collectives_equal_the_plans_volumes(results):
    for rank, per_rank in enumerate(results):
        got = per_rank["traffic"]
        want = got["formula"]
        counted = {k: got["counted"].get(k, 0) for k in ("sends", "all_gather", "reduce_scatter")}
        assert counted == {
            "sends": want.sends,
            "all_gather": want.all_gather,
            "reduce_scatter": want.reduce_scatter,
        }, (rank, got)
