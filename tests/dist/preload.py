"""What every rank imports, imported once per test process (opt-in).

With ``RANKS_START=forkserver``, ``tests/dist/harness.py`` forks its ranks
from a server that imported this module: each rank finds torch,
transformers, peft, the backend and the common families' modeling code
already imported instead of spending seconds of CPU on those imports in
every rank of every spawn (about half of a 4-rank spawn's CPU;
``RANKS_PROFILE`` shows it). Not the default: importing starts native
threads (torch's, transformers', pyarrow's ``jemalloc_bg_thd``) that a fork
does not carry, and a rank forked this way once died without a traceback.
A module missing here is imported by the rank as before.
"""

from __future__ import annotations

import importlib

MODULES = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "peft",
    "safetensors.torch",
    "pyarrow.fs",
    "ray_fsdp_backend",
    "ray_fsdp_backend.hf.models",
    "ray_fsdp_backend.trainer.train",
    "tests.dist.harness",
    "tests.hf_models",
    "tests.zoo_families",
)
FAMILIES = ("llama", "gpt2", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "mixtral")
"""The families most dist tests build (transformers imports a family's
modeling code lazily, on first use: about a second each)."""

for _name in MODULES:
    importlib.import_module(_name)
for _family in FAMILIES:
    importlib.import_module(f"transformers.models.{_family}.modeling_{_family}")
