"""Each rank's per-step seed (ray_fsdp_backend/distributed/seeding.py)."""

from __future__ import annotations

import torch

from ray_fsdp_backend.distributed.seeding import seed_step, step_seed


class Coordinates:
    def __init__(self, dp_rank: int, cp_rank: int, pp_rank: int = 0):
        self.dp_rank, self.cp_rank, self.pp_rank = dp_rank, cp_rank, pp_rank


def test_seeds_differ_across_data_coordinates_and_steps_and_runs():
    seeds = {
        step_seed(seed, step, dp, cp, pp)
        for seed in (0, 1)
        for step in (1, 2)
        for dp in range(4)
        for cp in range(2)
        for pp in range(3)
    }
    assert len(seeds) == 2 * 2 * 4 * 2 * 3
    assert all(0 <= s < 2**63 for s in seeds)


def test_seed_step_draws_per_data_coordinate_and_repeats_on_resume():
    def draws(dp, cp, step):
        seed_step(Coordinates(dp, cp), seed=7, step=step)
        return torch.rand(8)

    # tp ranks share dp and cp coordinates: the same masks; dp and cp ranks differ.
    assert torch.equal(draws(1, 0, 3), draws(1, 0, 3))
    assert not torch.equal(draws(0, 0, 3), draws(1, 0, 3))
    assert not torch.equal(draws(0, 0, 3), draws(0, 1, 3))
    assert not torch.equal(draws(0, 0, 3), draws(0, 0, 4))


def test_pipeline_stages_draw_different_masks():
    """The stages of one micro-batch hold different layers: seeded from (seed,
    step, dp, cp) alone every stage drew the same dropout masks."""

    def draws(pp):
        seed_step(Coordinates(0, 0, pp), seed=7, step=3)
        return torch.rand(8)

    assert not torch.equal(draws(0), draws(1))
    assert torch.equal(draws(1), draws(1))
