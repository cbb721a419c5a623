"""PURE schedule arithmetic: where each rank's stages sit under torch 2.13's
schedules, and each schedule's bubble. The schedules a config may name, and
the counts each one runs with, are settings
(:mod:`ray_fsdp_backend.settings.pipeline_schedules`)."""

from __future__ import annotations


def stage_indices(rank: int, stages: int, virtual: int, schedule: str) -> tuple[int, ...]:
    """The global stage indices pipeline rank ``rank`` of ``stages`` holds,
    as torch's schedules place them: loop style (rank r: r, r + P, ...) for
    the interleaved schedules, V shape (r and 2P - 1 - r) for ZBV, ``(r,)``
    with one stage per rank."""
    if schedule == "zbv_zero_bubble":
        return (rank, 2 * stages - 1 - rank)
    return tuple(rank + v * stages for v in range(virtual))


def bubble_fraction(
    stages: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1
) -> float:
    """The idle share of a step, with a forward (F), an input-gradient (B) and
    a weight-gradient (W) pass of equal time per micro-batch and stage:
    GPipe and 1F1B ``(P - 1) / (M + P - 1)``; interleaved 1F1B
    ``(P - 1) / (V M + P - 1)`` (Narayanan et al. 2021, arXiv:2104.04473:
    the bubble shrinks V-fold); interleaved zero bubble (torch's ZB1P, Qi et
    al. 2024, arXiv:2401.10241) idles ``(P - 1)(F + B - W)`` instead of
    1F1B's ``(P - 1)(F + B + W)``, a third: ``(P - 1) / (3 V M + P - 1)``;
    ZB-V 0 (the paper's and torch's claim, only when F = B = W)."""
    idle = stages - 1
    if schedule == "zbv_zero_bubble":
        return 0.0
    if schedule == "interleaved_zero_bubble":
        return idle / (3 * virtual * microbatches + idle)
    return idle / (virtual * microbatches + idle)
