"""Optional libraries kept out of processes that do not use them.

``torchao`` (the ``qlora`` extra) is imported by
:mod:`ray_fsdp_backend.ops.quantization` only, when a run quantises. This module
imports nothing heavy, so the ``ray-fsdp`` driver sets the guard before any
command reads a config (``plan`` / ``validate`` import no torch).
"""

from __future__ import annotations

import importlib
import sys


def keep_torchao_unimported() -> None:
    """Make this process import ``torchao`` only through
    :mod:`~ray_fsdp_backend.ops.quantization`'s quantising functions, never as a
    side effect (call it in a process that will not quantise: the
    ``ray-fsdp`` driver, a worker of a run without ``base_quantization``).

    transformers 5.25 imports ``torchao`` whenever it is installed
    (``modeling_utils`` -> ``quantizers.quantizer_torchao``), which prints
    13 lines per process on a CPU machine (its CUDA kernels not loading,
    "no triton", torch ``_pytree`` deprecations). A ``None`` entry in
    ``sys.modules`` is Python's documented way to say "not importable":
    ``importlib.util.find_spec`` then answers None, so transformers sees no
    torchao. Does nothing once ``torchao`` is imported."""
    sys.modules.setdefault("torchao", None)


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's ``__getattr__`` (PEP 562) that imports each public name's
    submodule on first use: ``exports`` maps a name to its submodule. A
    package whose ``__init__`` imported its torch-heavy submodules would
    make ``plan`` import torch through any of its torch-free ones
    (``hf.shapes``, ``dmuon.plan``)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__
