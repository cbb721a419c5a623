"""PURE schedule decisions: which schedules torch 2.13 runs with a given
stage, virtual-stage and micro-batch count, where each rank's stages sit, and
each schedule's bubble. No torch, no topology: ``config`` checks a schedule
with these before any worker starts."""

from __future__ import annotations

SINGLE_STAGE_SCHEDULES = ("1f1b", "gpipe")
"""Schedules with one stage per rank; the others take ``pipeline_virtual_stages``."""


REFUSED_SCHEDULES = {
    "zbv_zero_bubble": (
        "torch 2.13's ScheduleZBVZeroBubble fails in eval() (forward only, the held-out "
        "loss): its V shape hands a rank's two adjacent stages their gradients locally even "
        "without a backward (AssertionError \"can't steal_bwd_input if this stage doesn't have "
        'backward", measured on gloo with FSDP2 stages); use interleaved_zero_bubble'
    ),
}
"""Schedules torch names that this backend refuses, with the reason measured."""


def schedule_errors(
    schedule: str, stages: int, virtual: int, microbatches: int | None
) -> list[str]:
    """What torch 2.13's schedule ``schedule`` cannot run with ``stages``
    ranks (P), ``virtual`` stages per rank (V) and ``microbatches`` (M; None:
    P): a refused schedule (:data:`REFUSED_SCHEDULES`), one stage per rank
    for 1F1B and GPipe, V >= 2 for the interleaved schedules, and for those M
    a multiple of torch's rounds ``max(1, M // P)`` (its ValueError, before
    any worker starts)."""
    key = f"pipeline_schedule={schedule!r} with pipeline_virtual_stages={virtual}"
    if schedule in REFUSED_SCHEDULES:
        return [f"pipeline_schedule={schedule!r} is refused: {REFUSED_SCHEDULES[schedule]}"]
    if schedule in SINGLE_STAGE_SCHEDULES:
        return [] if virtual == 1 else [f"{key}: {schedule} runs one stage per rank; set it to 1"]
    if virtual < 2:
        return [f"{key}: an interleaved schedule needs at least 2 stages per rank"]
    micro = stages if microbatches is None else microbatches
    rounds = max(1, micro // stages)
    if micro % rounds:
        return [
            f"pipeline_microbatches={micro} with {key} and pipeline_parallel_size={stages}: "
            f"torch's interleaved schedules need M a multiple of max(1, M // P) = {rounds}"
        ]
    return []


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
