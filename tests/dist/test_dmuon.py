"""DMuon on 1, 2 and 4 gloo ranks against one process running torch's own
optimizers (``torch.optim.Muon`` on the block matrices, ``torch.optim.AdamW``
on the rest) on the full batch, with fp32 Newton–Schulz on both sides.

One spawn per world size; each runs FSDP (1-D mesh) and HSDP (2-D mesh)
through a 4-step schedule: a plain step, a step accumulated over two
micro-batches under ``no_sync``, a globally clipped step, a plain step. The
4-rank run also saves a sharded DCP checkpoint (the project's
``save_sharded``) after step 2, which the 2-rank run resumes with
``load_sharded`` (owners re-planned at the new size).
"""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from ray_fsdp_backend import FSDPConfig, dmuon
from ray_fsdp_backend.checkpoint import CheckpointStore, find_latest, load_sharded, save_sharded
from ray_fsdp_backend.dmuon import newton_schulz
from ray_fsdp_backend.planning.topology import REPLICATE_AXIS, SHARD_AXIS
from ray_fsdp_backend.strategies import build_strategy
from ray_fsdp_backend.strategies.dmuon import DMuonFSDPStrategy
from tests.dist.harness import run_ranks

VOCAB, DIM, BATCH, SEQ = 11, 8, 8, 5
STEPS = 4
ACCUM_STEP, CLIP_STEP, CKPT_AFTER = 1, 2, 2
MAX_NORM = 0.5
HYPER = dict(lr=0.02, momentum=0.9, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
ATOL = 1e-6


class Block(nn.Module):
    """Matrices with uneven row counts: ``gate`` has 3 rows, fewer than 4
    ranks; ``spare`` never gets a gradient."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.gate = nn.Linear(d, 3, bias=False)
        self.spare = nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.down(torch.tanh(self.up(self.norm(x))))
        return x + h * torch.sigmoid(self.gate(x)).mean(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def is_block_matrix(name: str, p: torch.Tensor) -> bool:
    return name.startswith("blocks.") and p.ndim == 2


def batch(step: int, micro: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per_rank = BATCH // world_size
    return tokens[rank * per_rank : (rank + 1) * per_rank]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def train(model, optimizer, steps, *, no_sync, clip, rank=0, world_size=1, log=None) -> dict:
    """The shared schedule. Returns ``log`` with the clipped step's total norm
    (``norms``) and, after each ``no_sync`` micro-batch, whether any parameter
    already had a (reduced, sharded) gradient (``reduced_in_no_sync``)."""
    log = {"norms": [], "reduced_in_no_sync": []} if log is None else log
    for step in steps:
        micro = 2 if step == ACCUM_STEP else 1
        for k in range(micro):
            quiet = no_sync(model) if k < micro - 1 else nullcontext()
            with quiet:
                (loss_of(model, batch(step, k, rank, world_size)) / micro).backward()
            if k < micro - 1:
                reduced = any(p.grad is not None for p in model.parameters())
                log["reduced_in_no_sync"].append(reduced)
        if step == CLIP_STEP:
            log["norms"].append(float(clip(model, optimizer)))
        optimizer.step()
        optimizer.zero_grad()
    return log


# ----------------------------------------------------------------- reference


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's iteration, transcribed in fp32 (torch's own is bf16)."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class TorchPair:
    """torch.optim.Muon + torch.optim.AdamW as one object for ``train``."""

    def __init__(self, model):
        named = list(model.named_parameters())
        self.muon = torch.optim.Muon([p for n, p in named if is_block_matrix(n, p)], **HYPER)
        self.adamw = torch.optim.AdamW([p for n, p in named if not is_block_matrix(n, p)], **ADAMW)

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self):
        self.muon.zero_grad()
        self.adamw.zero_grad()


@pytest.fixture(scope="module")
def reference():
    model = make_model()
    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz):
        log = train(
            model,
            TorchPair(model),
            range(STEPS),
            no_sync=lambda m: nullcontext(),
            clip=lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM),
        )
    return {n: p.detach().clone() for n, p in model.named_parameters()}, log["norms"]


# ------------------------------------------------------------ on every rank


def build_mesh(world_size: int, hybrid: bool):
    if hybrid:
        shape = (2, world_size // 2) if world_size > 1 else (1, 1)
        return init_device_mesh("cpu", shape, mesh_dim_names=(REPLICATE_AXIS, SHARD_AXIS))
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=(SHARD_AXIS,))


def build(world_size: int, hybrid: bool, bf16: bool = False):
    """The DMuon strategy (through ``build_strategy``), its wrap of the test
    model, and the optimizer; ``bf16``: mixed precision and bf16 Newton–Schulz.
    FSDP accumulates unsharded gradients under ``no_sync``; HSDP takes the
    default (reduce-scatter, defer the all-reduce): both defer the gradient."""
    mesh = build_mesh(world_size, hybrid)
    config = FSDPConfig(
        use_fsdp=True,
        use_dmuon=True,
        use_mixed_precision=bf16,
        fsdp_accumulate_unsharded=not hybrid,
    )
    strategy = build_strategy(config, device=torch.device("cpu"), local_rank=0, mesh=mesh)
    assert isinstance(strategy, DMuonFSDPStrategy)
    model = strategy.wrap(make_model())
    optimizer = dmuon.Muon(
        model,
        **HYPER,
        ns_dtype=torch.bfloat16 if bf16 else torch.float32,
        **{f"adamw_{k}": v for k, v in ADAMW.items()},
        # FSDP: several pipelined buckets (one matrix, or two small ones, each);
        # HSDP: the default, one bucket.
        **({} if hybrid else {"bucket_numel": 100}),
    )
    return strategy, model, optimizer


def runtime(strategy) -> tuple:
    """The strategy's ``no_sync`` and its global clip, as ``train`` takes them."""
    return strategy.no_sync, lambda m, o: strategy.clip_grad_norm(m, MAX_NORM, optimizer=o)


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


class CountingNS:
    """Counts the matrices this rank passes to Newton–Schulz."""

    def __init__(self):
        self.matrices = 0
        self.real = newton_schulz.zeropower_via_newtonschulz

    def __call__(self, stack, *args):
        self.matrices += stack.shape[0]
        return self.real(stack, *args)


def run_config(rank, world_size, hybrid, ckpt_dir=None) -> dict:
    """The schedule under one sharding mode; with ``ckpt_dir``, a DCP save
    after ``CKPT_AFTER`` steps."""
    strategy, model, opt = build(world_size, hybrid)
    no_sync, clip = runtime(strategy)
    counter = CountingNS()
    with mock.patch.object(newton_schulz, "zeropower_via_newtonschulz", counter):
        log = train(
            model, opt, range(1), no_sync=no_sync, clip=clip, rank=rank, world_size=world_size
        )
    first_step = dict(
        names=opt.last_step_stats.orthogonalized,
        ns_matrices=counter.matrices,
        momentum=opt.momentum_numel(),
        bytes_sent=opt.last_step_stats.bytes_sent,
        replica=strategy.mesh.get_local_rank(0) if hybrid else 0,
    )
    train(
        model,
        opt,
        range(1, CKPT_AFTER),
        no_sync=no_sync,
        clip=clip,
        rank=rank,
        world_size=world_size,
        log=log,
    )
    if ckpt_dir is not None:
        save_sharded(CheckpointStore.local(ckpt_dir), model, opt, strategy="dmuon")
    train(
        model,
        opt,
        range(CKPT_AFTER, STEPS),
        no_sync=no_sync,
        clip=clip,
        rank=rank,
        world_size=world_size,
        log=log,
    )
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, first_step)
    return dict(
        params=full_params(model),
        **log,
        per_rank=per_rank,
        groups=[g["name"] for g in opt.param_groups],
    )


def resume(rank, world_size, ckpt_dir) -> dict:
    """Load the checkpoint saved by the other world size and finish the run."""
    strategy, model, opt = build(world_size, hybrid=False)
    store = CheckpointStore.local(ckpt_dir)
    load_sharded(store, find_latest(store), model, opt)
    no_sync, clip = runtime(strategy)
    train(
        model,
        opt,
        range(CKPT_AFTER, STEPS),
        no_sync=no_sync,
        clip=clip,
        rank=rank,
        world_size=world_size,
    )
    return full_params(model)


def mismatched_plan(rank, world_size) -> str:
    """Ranks that choose different dedicated matrices: all must raise."""
    _, model, _ = build(world_size, hybrid=False)
    try:
        dmuon.Muon(
            model,
            lr=0.01,
            is_dedicated=lambda n, p: is_block_matrix(n, p) and (rank == 0 or "spare" not in n),
        )
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def column_sharded(rank, world_size) -> str:
    """Blocks sharded on dim 1: rejected with the parameter's name, before
    any collective (the same on every rank)."""
    mesh = build_mesh(world_size, hybrid=False)
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    fully_shard(model, mesh=mesh)
    try:
        dmuon.Muon(model, lr=0.01)
    except ValueError as exc:
        return str(exc)
    return "no error"


def bf16_run(rank, world_size) -> dict:
    """The whole schedule under bf16 mixed precision with bf16 Newton–Schulz
    (the defaults of a real run)."""
    strategy, model, opt = build(world_size, hybrid=False, bf16=True)
    no_sync, clip = runtime(strategy)
    train(model, opt, range(STEPS), no_sync=no_sync, clip=clip, rank=rank, world_size=world_size)
    return full_params(model)


def on_ranks(rank, world_size, ckpt_save=None, ckpt_load=None) -> dict:
    out = {
        mode: run_config(rank, world_size, mode == "hybrid", ckpt_save if mode == "full" else None)
        for mode in ("full", "hybrid")
    }
    if ckpt_load is not None:
        out["resumed"] = resume(rank, world_size, ckpt_load)
        errors = [None] * world_size
        dist.all_gather_object(errors, mismatched_plan(rank, world_size))
        out["mismatch_errors"] = errors
        out["placement_error"] = column_sharded(rank, world_size)
        out["bf16"] = bf16_run(rank, world_size)
    return out


# -------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dmuon_ckpt"))


@pytest.fixture(scope="module")
def runs(checkpoint_dir):
    """world size -> rank 0's results. 4 ranks first: it writes the checkpoint."""
    return {
        4: run_ranks(on_ranks, 4, checkpoint_dir, None),
        2: run_ranks(on_ranks, 2, None, checkpoint_dir),
        1: run_ranks(on_ranks, 1),
    }


def assert_params_close(got, want, what):
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= ATOL, f"{what}: {name} differs from the reference by {err:.2e}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("mode", ["full", "hybrid"])
def test_matches_torch_muon_and_adamw(runs, reference, world_size, mode):
    ref_params, ref_norms = reference
    result = runs[world_size][mode]
    assert result["groups"] == [dmuon.MUON_GROUP, dmuon.ADAMW_GROUP]
    assert_params_close(result["params"], ref_params, f"{mode} at {world_size} ranks")
    # One global norm over Muon and AdamW gradients, equal to the full model's.
    assert result["norms"] == pytest.approx(ref_norms, rel=1e-5)
    assert ref_norms[0] > MAX_NORM  # the clipped step did clip
    # no_sync really deferred the reduction (numbers alone cannot tell).
    assert result["reduced_in_no_sync"] == [False]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("mode", ["full", "hybrid"])
def test_each_matrix_orthogonalised_once_per_replica_group(runs, world_size, mode):
    per_rank = runs[world_size][mode]["per_rank"]
    ref = make_model()
    dedicated = {n: p.numel() for n, p in ref.named_parameters() if is_block_matrix(n, p)}
    total = sum(dedicated.values())
    for replica in {r["replica"] for r in per_rank}:
        group = [r for r in per_rank if r["replica"] == replica]
        names = [n for r in group for n in r["names"]]
        assert sorted(names) == sorted(dedicated)  # each exactly once in the group
        assert sum(r["ns_matrices"] for r in group) == len(dedicated)
        # Momentum is split over the shard group, not replicated inside it.
        assert sum(r["momentum"] for r in group) == total
        assert max(r["momentum"] for r in group) <= total / len(group) + 4 * 2 * DIM
        if len(group) > 1:
            assert all(r["bytes_sent"] > 0 for r in group)


def test_checkpoint_at_4_ranks_resumes_at_2(runs, reference):
    assert_params_close(runs[2]["resumed"], runs[4]["full"]["params"], "resumed at 2 ranks")
    assert_params_close(runs[2]["resumed"], reference[0], "resumed vs reference")


def test_ranks_with_different_plans_all_raise(runs):
    errors = runs[2]["mismatch_errors"]
    assert all("different ownership plans" in e for e in errors), errors


def test_params_not_sharded_on_rows_are_rejected(runs):
    error = runs[2]["placement_error"]
    assert "'blocks.0.up.weight' has placements (Shard(dim=1),)" in error, error


def test_bf16_mixed_precision_stays_near_the_fp32_reference(runs, reference):
    got, want = runs[2]["bf16"], reference[0]
    start = dict(make_model().named_parameters())
    assert all(torch.isfinite(t).all() for t in got.values())
    # The whole update (all parameters) points where the fp32 one does.
    moved = torch.cat([(want[n] - start[n]).flatten() for n in want])
    off = torch.cat([(got[n] - want[n]).flatten() for n in want])
    assert off.norm() <= 0.2 * moved.norm(), float(off.norm() / moved.norm())
