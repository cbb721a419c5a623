"""What ``ray-fsdp train`` checks before any worker starts, beyond the config.

:func:`storage_errors`: ``run.storage_path`` exists or can be created and is
writable (an object store: its bucket is reachable). It is part of the
static check (``validate``, ``plan`` and ``train`` run it before Ray).

:func:`cluster_errors`: the workers' resources against what the Ray cluster
has (``ray.cluster_resources()``), read after connecting and before the
trainer is built. Ray would otherwise wait for GPUs that never come,
"worker group startup timed out after 60.0 seconds", three times over.
Both are pure decisions on what they are given (the file system aside).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ray_fsdp_backend.planning.elastic import worker_range

KEY = "run.storage_path"


def storage_errors(path: str | None, key: str = KEY) -> list[str]:
    """One message when the run directory's parent cannot be written (empty:
    fine; None is Ray's default, ``~/ray_results``, created by Ray)."""
    if path is None:
        return []
    if "://" in path:
        return _object_store_errors(path, key)
    full = os.path.abspath(os.path.expanduser(path))
    existing = full
    while not os.path.exists(existing):  # the nearest ancestor that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [f"{key}={path!r}: {existing} is a file, not a directory"]
    if os.access(existing, os.W_OK | os.X_OK):
        return []
    what = "is not writable" if existing == full else f"cannot be created ({existing} is not)"
    return [f"{key}={path!r} {what}: choose a directory you can write to"]


def _object_store_errors(uri: str, key: str) -> list[str]:
    """The bucket of ``uri`` reachable (its credentials, endpoint and name):
    one ``get_file_info`` on it through ``pyarrow.fs``, as Ray opens it."""
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(uri)
        bucket = path.strip("/").split("/", 1)[0]
        info = fs.get_file_info(bucket)
    except (ValueError, OSError) as exc:
        return [f"{key}={uri!r} cannot be reached: {exc}"]
    if info.type == pafs.FileType.NotFound:
        return [f"{key}={uri!r}: bucket {bucket!r} not found"]
    return []


def cluster_errors(scaling, resources: Mapping[str, float]) -> list[str]:
    """The ``scaling:`` section against the cluster's total ``resources``:
    one message per resource the smallest worker group needs more of than
    the cluster has (``use_gpu: true`` counts one GPU per worker unless
    ``resources_per_worker`` says otherwise; ``auto`` asks for none here)."""
    low, _ = worker_range(scaling.num_workers)
    per_worker = dict(scaling.resources_per_worker or {})
    if scaling.use_gpu is True:
        per_worker.setdefault("GPU", 1)
    elif "GPU" not in per_worker or not per_worker["GPU"]:
        per_worker.pop("GPU", None)
    has = ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU"))
    errors = []
    for name, amount in sorted(per_worker.items()):
        need, there = amount * low, resources.get(name, 0)
        if need <= there:
            continue
        ask = f"scaling.num_workers={scaling.num_workers} x {amount:g} {name}"
        if name == "GPU":
            ask = f"scaling.use_gpu={scaling.use_gpu!r} with {ask}"
            fix = "set scaling.use_gpu: false (or auto) to train on CPUs, or fewer workers"
        else:
            ask += " (scaling.resources_per_worker)"
            fix = "lower scaling.resources_per_worker or scaling.num_workers"
        errors.append(
            f"{ask} needs {need:g} {name}, but the Ray cluster has {there:g} "
            f"(it has: {has or 'nothing'}): {fix}"
        )
    return errors
