"""Each rank's extra-state file of a checkpoint: the caller's state (step,
data position, scheduler), this process's RNG generators and its rank-local
buffers, written with ``torch.save`` and read back with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
import random
from collections.abc import Mapping
from typing import Any

import torch

from ray_fsdp_backend.checkpoint.layout import extra_state_name
from ray_fsdp_backend.checkpoint.store import CheckpointStore, torn_object


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG generators: torch CPU, the current CUDA device's
    (when CUDA is in use), Python's ``random`` and NumPy's global one."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # As a tensor: weights_only loading refuses NumPy arrays.
    state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set the generators ``capture_rng_state`` recorded."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def encode_extra_state(
    extra_state: Mapping[str, Any] | None, buffers: Mapping[str, torch.Tensor] | None = None
) -> bytes:
    """This rank's extra-state file: the caller's state, the RNG state and
    this rank's buffers (see :mod:`.buffers`).

    Raises:
        ValueError: it would not load with ``weights_only=True`` (only
            tensors, numbers, strings, None and lists/tuples/dicts of them).
    """
    buf = io.BytesIO()
    state = {"user": dict(extra_state or {}), "rng": capture_rng_state()}
    torch.save({**state, "buffers": dict(buffers or {})}, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise ValueError(
            "extra_state must hold only tensors, numbers, strings, bools, None and "
            f"lists/tuples/dicts of them (it is loaded with weights_only=True): {exc}"
        ) from None
    return data


def read_extra_state(store: CheckpointStore, name: str, rank: int) -> tuple[dict[str, Any], bool]:
    """This rank's extra state if it saved one, else rank 0's; and whether it
    was this rank's own (only then are its RNG generators restored)."""
    own = f"{name}/{extra_state_name(rank)}"
    path = own if store.exists(own) else f"{name}/{extra_state_name(0)}"
    data = store.read_file(path)
    try:
        return torch.load(io.BytesIO(data), weights_only=True), path == own
    except (EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
        raise torn_object(store.path(path), len(data), None, str(exc)) from exc
