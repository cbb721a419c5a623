"""``broadcast_from_rank0`` on 2 gloo ranks: rank 0's result reaches every
rank, and so does its error, even one pickle cannot carry (a class made at
run time, as Ray's ``RayTaskError(ValueError)`` of a failing reward task)."""

from __future__ import annotations

import torch.distributed as dist

from tests.dist.harness import run_ranks


def _fail(error: Exception):
    raise error


def _ranks(rank: int, world: int) -> list[dict]:
    from ray_fsdp_backend.distributed.collectives import broadcast_from_rank0

    out = {"value": broadcast_from_rank0(lambda: {"rank": rank})}
    made_at_run_time = type("RayTaskError(ValueError)", (ValueError,), {})
    errors = {
        "plain": KeyError("no prompt"),
        "unpicklable": made_at_run_time("reward my_rewards:score raised ZeroDivisionError"),
    }
    for name, error in errors.items():
        try:
            broadcast_from_rank0(lambda error=error: _fail(error))
        except Exception as exc:  # every rank gets here, none waits
            out[name] = (type(exc).__name__, str(exc))
    views = [None] * world
    dist.all_gather_object(views, out)
    return views


def test_results_and_errors_reach_every_rank():
    rank0, rank1 = run_ranks(_ranks, 2)
    for view in (rank0, rank1):
        assert view["value"] == {"rank": 0}
        assert view["plain"] == ("KeyError", "'no prompt'")
        assert "reward my_rewards:score raised ZeroDivisionError" in view["unpicklable"][1]
    assert rank0["unpicklable"][0] == "RayTaskError(ValueError)"  # its own, traceback and all
    assert rank1["unpicklable"] == (
        "RuntimeError",
        "RayTaskError(ValueError) on rank 0: reward my_rewards:score raised ZeroDivisionError",
    )
