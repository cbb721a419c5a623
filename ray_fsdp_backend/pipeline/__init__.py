"""Pipeline parallelism's runtime: stages on the outermost mesh axis ``pp``,
FSDP2 (and TP) inside each stage, torch.distributed.pipelining's schedules.

- :mod:`.families`: the Hugging Face decoder families the split knows;
- :mod:`.split`: cut a decoder down to one stage's modules, keeping the
  original parameter names;
- :mod:`.step`: ``ctx.pipeline_step``, one optimizer step's schedule.

The pure half (the mesh with ``pp`` outermost, which layers each stage holds,
the micro-batch count, each rank's stages and the bubble) is planning:
:mod:`ray_fsdp_backend.planning.pipeline_layout` and
:mod:`ray_fsdp_backend.planning.pipeline_schedules`, re-exported here.
"""

from ray_fsdp_backend.planning.pipeline_layout import (
    StagePlan,
    pipeline_mesh_layout,
    plan_stages,
    resolve_microbatches,
)
from ray_fsdp_backend.planning.pipeline_schedules import bubble_fraction

__all__ = [
    "StagePlan",
    "bubble_fraction",
    "pipeline_mesh_layout",
    "plan_stages",
    "resolve_microbatches",
]
