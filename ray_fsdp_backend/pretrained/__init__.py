"""Pretrained Hugging Face models: sharded loading from safetensors.

- :mod:`.reader`: the checkpoint's files and headers, and a DCP reader that
  reads byte ranges through ``pyarrow.fs`` (local disk or object storage).
- :mod:`.load`: :func:`load_pretrained`, checks before any weight is read.
- :mod:`.hf`: ``transformers`` helpers (imported on use; optional extra).
"""

from ray_fsdp_backend.pretrained.load import load_pretrained
from ray_fsdp_backend.pretrained.reader import PretrainedCheckpointError

__all__ = ["PretrainedCheckpointError", "load_pretrained"]
