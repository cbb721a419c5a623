"""Pipeline parallelism: stages on the outermost mesh axis ``pp``, FSDP2 (and
TP) inside each stage, torch.distributed.pipelining's schedules.

- :mod:`.layout`: pure decisions (the mesh with ``pp`` outermost, which
  layers each stage holds, micro-batch count);
- :mod:`.schedules`: pure schedule decisions (what torch's schedules run,
  each rank's stages, the bubble);
- :mod:`.split`: cut a decoder down to one stage's modules, keeping the
  original parameter names;
- :mod:`.step`: ``ctx.pipeline_step``, one optimizer step's schedule.
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
