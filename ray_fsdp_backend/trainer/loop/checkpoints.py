"""The trainer's checkpoint hooks: restore once, save every ``checkpoint_every`` steps."""

from __future__ import annotations

import logging
from collections.abc import Callable

_logger = logging.getLogger(__name__)


class CheckpointHooks:
    """Checkpoints every ``every`` steps through the context's helpers (each
    a ``ray.train.report`` with the checkpoint); the metrics of other logged
    steps go to ``report`` when given (benchmarks, tests), never to Ray: a
    ``ray.train.report`` is a barrier that waits up to 2 s for Ray 2.60's
    controller to poll (``DEFAULT_HEALTH_CHECK_INTERVAL_S``), which would
    hold the step. The loop calls :meth:`restore` once and :meth:`report` at
    every logged step.
    """

    def __init__(
        self,
        ctx,
        every: int,
        async_save: bool = False,
        report: Callable[[dict], None] | None = None,
    ) -> None:
        self.ctx, self.every, self.async_save = ctx, every, async_save
        self.enabled = every > 0
        self._report = report

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    def restore(self, model, optimizer, schedule, batches) -> dict:
        """Load the latest checkpoint if the run has one; returns its extra
        state (``step``, ``skipped_steps``, ...; empty: nothing to resume)."""
        extra = self.ctx.restore_checkpoint(model, optimizer)
        if not extra:
            return {}
        batches.load_state_dict(extra["data"])
        schedule.load_state_dict(extra["schedule"])
        if self.ctx.world_rank == 0:
            _logger.info("resumed from step %d", extra["step"])
        return extra

    def report(self, step, model, optimizer, metrics, extra_state) -> None:
        """A checkpoint when one is due (every rank), else ``metrics`` to ``report``."""
        if self.due(step):
            self.ctx.save_checkpoint(
                model, optimizer, metrics, extra_state=extra_state, async_save=self.async_save
            )
        elif self._report is not None:
            self._report(metrics)
