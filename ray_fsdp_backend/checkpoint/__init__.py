"""The backend's own sharded (DCP) checkpoints and exact resume.

Hugging Face weights, both ways, live in :mod:`ray_fsdp_backend.hf`.

- :mod:`.layout` (pure): names, completeness, which checkpoint to resume,
  key/shape mismatches.
- :mod:`.store`: the filesystem a run's checkpoints live on.
- :mod:`.sharded`: DCP save/load of model, optimizer and extra state in any
  ``torch.distributed`` job (:mod:`.fit` checks a checkpoint fits before a
  load; :mod:`.extra_state` is each rank's own file); :class:`AsyncCheckpointer` saves in the
  background on a process group it owns.
- :mod:`.ray_run`: the same inside a Ray Train run (report, restore after a
  restart); :class:`RunCheckpoints` holds one worker's state of the run.

``TrainContext.save_checkpoint`` / ``restore_checkpoint`` delegate to the
context's ``RunCheckpoints``, created on first use and closed at teardown.
"""

from ray_fsdp_backend.checkpoint.fit import CheckpointMismatchError
from ray_fsdp_backend.checkpoint.ray_run import RunCheckpoints
from ray_fsdp_backend.checkpoint.sharded import (
    AsyncCheckpointer,
    find_latest,
    load_sharded,
    save_sharded,
)
from ray_fsdp_backend.checkpoint.store import CheckpointStore

__all__ = [
    "AsyncCheckpointer",
    "CheckpointMismatchError",
    "CheckpointStore",
    "RunCheckpoints",
    "find_latest",
    "load_sharded",
    "save_sharded",
]
