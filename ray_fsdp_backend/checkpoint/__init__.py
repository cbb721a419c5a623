"""The backend's own sharded (DCP) checkpoints and exact resume.

Hugging Face weights, both ways, live in :mod:`ray_fsdp_backend.hf`.

- :mod:`.layout` (pure): names, completeness, which checkpoint to resume,
  key/shape mismatches.
- :mod:`.store`: the filesystem a run's checkpoints live on.
- :mod:`.sharded`: DCP save/load of model, optimizer and extra state in any
  ``torch.distributed`` job.
- :mod:`.ray_run`: the same inside a Ray Train run (report, restore after a
  restart).

``TrainContext.save_checkpoint`` / ``restore_checkpoint`` delegate here.
"""

from ray_fsdp_backend.checkpoint.ray_run import restore_checkpoint, save_checkpoint
from ray_fsdp_backend.checkpoint.sharded import (
    CheckpointMismatchError,
    find_latest,
    load_sharded,
    save_sharded,
)
from ray_fsdp_backend.checkpoint.store import CheckpointStore

__all__ = [
    "CheckpointMismatchError",
    "CheckpointStore",
    "find_latest",
    "load_sharded",
    "restore_checkpoint",
    "save_checkpoint",
    "save_sharded",
]
