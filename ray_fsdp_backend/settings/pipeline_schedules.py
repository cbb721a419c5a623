"""PURE: the pipeline schedules a config may name (``pipeline_schedule``) and
which of them torch 2.13 runs with a given stage, virtual-stage and
micro-batch count. No torch: :mod:`.checks` refuses a schedule with these
before any worker starts; where each rank's stages sit and each schedule's
bubble are planning (:mod:`ray_fsdp_backend.planning.pipeline_schedules`)."""

from __future__ import annotations

PIPELINE_SCHEDULES = (
    "1f1b",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
)
"""``pipeline_schedule`` values (the first two: one stage per rank)."""


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
