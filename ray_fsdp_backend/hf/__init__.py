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
- :mod:`.check`: :func:`check_pretrained`, a checkpoint's existence and LoRA
  targets, from the driver before anything starts.
- :mod:`.models`: ``transformers`` helpers (imported on use; optional extra).
"""

from ray_fsdp_backend.hf.check import check_pretrained
from ray_fsdp_backend.hf.export import export_model
from ray_fsdp_backend.hf.load import load_pretrained
from ray_fsdp_backend.hf.reader import PretrainedCheckpointError
from ray_fsdp_backend.hf.target import ExportTargetError

__all__ = [
    "ExportTargetError",
    "PretrainedCheckpointError",
    "check_pretrained",
    "export_model",
    "load_pretrained",
]
