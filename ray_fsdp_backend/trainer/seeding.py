"""The trainer's per-step seeding: the library's (:mod:`ray_fsdp_backend.seeding`,
``ctx.seed_step`` in a loop of your own)."""

from ray_fsdp_backend.seeding import seed_step, step_seed

__all__ = ["seed_step", "step_seed"]
