"""The Hugging Face format, both ways: sharded loading from and export to safetensors.

- :mod:`.entries`, :mod:`.reader`: the checkpoint's files and headers, and a
  DCP reader that reads byte ranges through ``pyarrow.fs`` (local disk or
  object storage).
- :mod:`.experts`: per-expert checkpoint tensors fused into a model's stacked
  expert parameters.
- :mod:`.load`: :func:`load_pretrained`, checks before any weight is read.
- :mod:`.export`, :mod:`.writer`: :func:`export_model`, full weights in
  Hugging Face layout (or one safetensors file) from sharded state;
  :mod:`.target`: what an export refuses (a non-empty target without
  ``overwrite``, one not every rank sees) and checks before its index.
- :mod:`.stream`: :func:`stream_weights`, the export's tensors in buckets
  (an RL loop's weight sync to its rollout engines).
- :mod:`.check`: :func:`check_pretrained`, a checkpoint's existence and LoRA
  targets, from the driver before anything starts.
- :mod:`.models`: ``transformers`` helpers (imported on use; optional extra).
- :mod:`.shapes`: a local checkpoint's parameter shapes, for ``plan`` (no torch).
"""

from ray_fsdp_backend.compat.optional_imports import lazy_exports

_EXPORTS = {
    "ExportTargetError": "target",
    "PretrainedCheckpointError": "reader",
    "check_pretrained": "check",
    "export_model": "export",
    "load_pretrained": "load",
    "stream_weights": "stream",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)  # plan imports .shapes and .check without torch
