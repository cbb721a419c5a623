"""Worker functions for test_reporting.py (importable by Ray workers)."""

from __future__ import annotations


def train_counting_reports(loop_config: dict) -> dict:
    """The trainer's real loop with ``ray.train.report`` counted on this
    worker (checkpoint saves report through it too)."""
    import ray.train

    from ray_fsdp_backend.trainer.loop.train import train_loop_per_worker

    real, steps = ray.train.report, []

    def counting(metrics, *args, **kwargs):
        steps.append(int(metrics["step"]))
        return real(metrics, *args, **kwargs)

    ray.train.report = counting
    try:
        history = train_loop_per_worker(loop_config)
    finally:
        ray.train.report = real
    return {"logged": [m["step"] for m in history], "reported": steps}
