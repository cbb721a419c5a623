"""DMuon with matrices split over teams of ranks, against one process.

Where whole-matrix owners leave ranks idle, the planner splits matrices over
teams (``plan.team_size > 1``): each member orthogonalises a slice of the
longer side; the team all-reduces its Gram matrices and all-gathers the
rows of the polynomial each member formed. Checked on real gloo
ranks at two levels:

- ``zeropower_via_newtonschulz_split`` on 2 and 3 ranks against the whole
  matrix's ``zeropower_via_newtonschulz`` (fp32 and bf16), for tall, wide and
  square stacks whose sides do not divide evenly (and a Gram matrix with
  fewer rows than members);
- the optimizer on 3 and 4 ranks (FSDP2, 1-D mesh; teams of 2 on process
  groups of their own, at 3 beside a rank in no team) and under HSDP (2 x 2:
  one team of the whole shard group in each replica; 2 x 3: a team of 2 in
  each replica's shard group of 3), against ``torch.optim.Muon`` in fp32 on
  the full batch.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch import nn
from torch.distributed.fsdp import fully_shard

from ray_fsdp_backend import dmuon
from ray_fsdp_backend.dmuon import newton_schulz
from ray_fsdp_backend.dmuon.exchange import Team
from ray_fsdp_backend.dmuon.plan import row_range, team_traffic
from tests.dist.harness import run_ranks
from tests.dist.test_dmuon import HYPER, build_mesh, fp32_newton_schulz

SHAPES = {"tall": (45, 16), "wide": (16, 43), "small": (3, 8)}
"""Split in teams of 2 (sides that 2 does not divide): at 4 ranks tall and
wide, one team each; at 3 tall only, beside rank 2, in no team."""
SQUARE = {"square": (24, 24), "small": (3, 8)}
"""Split at a shard group of 2 (HSDP 2 x 2): the square, in a team of 2."""
BATCH, STEPS = 12, 3


class Net(nn.Module):
    """One bias-free linear layer per shape, each fed its own slice of the
    input, so that every matrix gets a gradient of its own."""

    def __init__(self, shapes: dict[str, tuple[int, int]]):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict(
            {name: nn.Linear(cols, rows, bias=False) for name, (rows, cols) in shapes.items()}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(
            torch.tanh(layer(x[:, : layer.in_features])).sub(0.3).square().mean()
            for layer in self.layers.values()
        )


def inputs(step: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    x = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(step))
    per_rank = BATCH // world_size
    return x[rank * per_rank : (rank + 1) * per_rank]


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    """torch.optim.Muon (fp32 Newton–Schulz) on the full batch."""
    out = {}
    for name, shapes in (("three", SHAPES), ("square", SQUARE)):
        model = Net(shapes)
        opt = torch.optim.Muon(model.parameters(), **HYPER)
        with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz):
            for step in range(STEPS):
                model(inputs(step)).backward()
                opt.step()
                opt.zero_grad()
        out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# ------------------------------------------------------------ on every rank


def split_ns(rank, world_size) -> dict:
    """Each rank's slices of tall, wide and square stacks through the split
    iteration; relative errors of the gathered result, and of the whole
    matrix's iteration in the same dtype, against the whole one in fp32."""
    errors = {}
    for shape in ((45, 16), (16, 43), (24, 24), (5, 40), (2, 50)):
        stack = torch.randn(3, *shape, generator=torch.Generator().manual_seed(sum(shape)))
        tall = shape[0] > shape[1]
        start, stop = row_range(max(shape), world_size, rank)
        piece = stack[:, start:stop] if tall else stack[:, :, start:stop]
        for dtype in (torch.float32, torch.bfloat16):
            mine = newton_schulz.zeropower_via_newtonschulz_split(
                piece, Team(None, rank, world_size), tall, dtype=dtype
            )
            parts = [None] * world_size
            dist.all_gather_object(parts, mine.float())
            got = torch.cat(parts, dim=1 if tall else 2)
            exact = newton_schulz.zeropower_via_newtonschulz(stack, dtype=torch.float32)
            whole = newton_schulz.zeropower_via_newtonschulz(stack, dtype=dtype).float()
            errors[(shape, str(dtype))] = tuple(
                float((x - exact).norm() / exact.norm()) for x in (got, whole)
            )
    return errors


def train_split(rank, world_size, shapes, hybrid) -> dict:
    mesh = build_mesh(world_size, hybrid)
    model = Net(shapes)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(
        model, **HYPER, ns_dtype=torch.float32, is_dedicated=lambda n, p: p.ndim == 2
    )
    for step in range(STEPS):
        model(inputs(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    stats = [None] * world_size
    dist.all_gather_object(stats, opt.last_step_stats)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return dict(params=params, plan=opt.plan, stats=stats)


@pytest.fixture(scope="module")
def runs() -> dict:
    return {
        "split_ns_2": run_ranks(split_ns, 2),
        "split_ns_3": run_ranks(split_ns, 3),
        "full_4": run_ranks(train_split, 4, SHAPES, False),
        "full_3": run_ranks(train_split, 3, SHAPES, False),
        "hybrid_4": run_ranks(train_split, 4, SQUARE, True),
        "hybrid_6": run_ranks(train_split, 6, SHAPES, True),
    }


# ------------------------------------------------------------------- checks


@pytest.mark.parametrize("world_size", [2, 3])
def test_split_newton_schulz_matches_the_whole_matrix(runs, world_size):
    for (shape, dtype), (split, whole) in runs[f"split_ns_{world_size}"].items():
        # fp32: the same iteration up to association. bf16 rounds every
        # product, in the whole iteration too: the split one must be about
        # as close to the exact result as torch's own bf16 iteration is.
        bound = 1e-5 if "float32" in dtype else 1.5 * whole
        assert 0 < split <= bound, f"{shape} {dtype} at {world_size}: {split:.2e} ({whole:.2e})"
        assert "float32" in dtype or whole > 1e-3  # bf16 really rounded


@pytest.mark.parametrize(
    "run, team_size, split",
    [
        ("full_4", 2, {"tall", "wide"}),
        ("full_3", 2, {"tall"}),
        ("hybrid_4", 2, {"square"}),
        ("hybrid_6", 2, {"tall"}),
    ],
)
def test_split_matrices_match_torch_muon(runs, references, run, team_size, split):
    result = runs[run]
    plan = result["plan"]
    assert plan.team_size == team_size
    names = [spec.name.split(".")[1] for spec in plan.matrices]
    assert {n for i, n in enumerate(names) if plan.is_split(i)} == split
    want = references["square" if run == "hybrid_4" else "three"]
    for name, got in result["params"].items():
        err = (got - want[name]).abs().max().item()
        assert err <= 1e-6, f"{run}: {name} differs from torch.optim.Muon by {err:.2e}"
    # Every member of a team orthogonalised its slice of each split matrix,
    # and the team's Gram all-reduces were counted with the exchanges.
    stats = result["stats"]
    group = plan.num_ranks
    for replica in range(len(stats) // group):
        ranks = range(replica * group, (replica + 1) * group)
        for i, spec in enumerate(plan.matrices):
            orthogonalised = {r % group for r in ranks if spec.name in stats[r].orthogonalized}
            assert orthogonalised == set(plan.team(i)), spec.name


def test_teams_move_the_gram_matrices_and_nothing_else(runs):
    """At 4 ranks in teams of 2, each rank sends the rows it holds of other
    ranks' pieces, then the rows of its pieces that other ranks hold, plus,
    per split matrix, a ring all-reduce of the squared norm, and at each of
    the 5 iterations one of the ``m x m`` Gram matrix and an all-gather of
    its half of the rows of ``b A + c A^2`` (all fp32 here): what
    ``ray-fsdp plan`` reports as ``team_traffic``."""
    result = runs["full_4"]
    plan, stats = result["plan"], result["stats"]
    for rank, s in enumerate(stats):
        exchanged = team = 0
        for i, spec in enumerate(plan.matrices):
            start, stop = row_range(spec.shape[0], 4, rank)
            exchanged += (stop - start) * spec.shape[1]  # held: out to the pieces' ranks
            if rank in plan.team(i):
                r0, r1, c0, c1 = plan.piece(i, rank)
                mine = max(0, min(stop, r1) - max(start, r0)) * (c1 - c0)
                exchanged += (r1 - r0) * (c1 - c0) - 2 * mine  # piece: back to its holders
            if plan.is_split(i) and rank in plan.team(i):
                m = min(spec.shape)
                team += 1 + 5 * (m * m + -(-m // 2) * m)  # ring, k = 2
        assert team > 0
        assert s.bytes_sent == 4 * (exchanged + team), rank
        assert team_traffic(plan, rank) == team
