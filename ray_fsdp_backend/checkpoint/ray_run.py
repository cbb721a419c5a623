"""Checkpoints of a Ray Train run: where they live and how Ray learns of them.

Every Ray Train quirk the checkpoint code depends on is handled here
(measured on Ray 2.60, Train V2):

- ``ray.train.report`` synchronises ranks only at its start (agreeing on the
  directory name); each rank then uploads its own files and returns. A marker
  written after ``report`` could race the uploads, so ranks write their
  shards straight into the run's storage, rank 0 writes ``COMPLETE`` after a
  barrier, and only then do all ranks report the finished directory with
  ``CheckpointUploadMode.NO_UPLOAD``. Ray therefore never registers an
  incomplete checkpoint.
- Ray registers a report asynchronously (the controller polls the workers):
  a worker that dies right after ``report`` returned can make the restarted
  group get the checkpoint before that one from ``ray.train.get_checkpoint()``.
  Restore therefore takes the newest complete checkpoint in the run's storage
  (``ray.train.get_context().get_storage()``, a DeveloperAPI) and falls back
  to the handed one (e.g. ``resume_from_checkpoint``) only when the run has
  none of its own.
- Ray's ``num_to_keep`` counts only registered checkpoints, so one completed
  but never registered (its worker died right after saving) would stay
  forever. Rank 0 deletes such orphans beyond the newest ``num_to_keep``
  complete checkpoints, reading which ones Ray registered from its
  ``checkpoint_manager_snapshot.json`` in the run's storage: after each
  commit those older than a registered one (:func:`layout.
  compute_retention_deletions`), and when a new worker group restores, all
  of them and the half-written debris of killed workers (:func:`layout.
  compute_restart_deletions`): Ray drops the pending reports of a worker
  group it shuts down, so what it has not registered by then it never will.
  Ray deletes the checkpoints it drops itself, and fails on one already
  gone: anything it ever registered is left to it.
- Asynchronous saves report with ``CheckpointUploadMode.ASYNC`` and an
  upload function that waits for the background write and, on rank 0,
  commits: ``report`` returns at once, Ray registers the checkpoint only after
  the function returned on every rank, and it waits for pending uploads when
  the training function ends (its upload thread pool is shut down with
  wait). A failed background write fails the run from Ray's upload thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

import ray.train
import torch
import torch.distributed as dist
from torch import nn

from ray_fsdp_backend.checkpoint.layout import (
    choose_resume,
    compute_restart_deletions,
    compute_retention_deletions,
    names_in,
)
from ray_fsdp_backend.checkpoint.sharded import (
    AsyncCheckpointer,
    CheckpointStorageError,
    PendingSave,
    load_sharded,
    naming_store,
    save_sharded,
)
from ray_fsdp_backend.checkpoint.store import CheckpointStore
from ray_fsdp_backend.distributed.collectives import broadcast_from_rank0
from ray_fsdp_backend.storage.retrying_fs import unwrap

_logger = logging.getLogger(__name__)

# Ray Train 2.60 writes its registered checkpoints here, under the run's directory.
_RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def run_store() -> CheckpointStore:
    """The store of this run: ``RunConfig(storage_path, name)``'s directory."""
    storage = ray.train.get_context().get_storage()
    return CheckpointStore.retrying(storage.storage_filesystem, storage.experiment_fs_path)


def handed_store(checkpoint: ray.train.Checkpoint) -> tuple[CheckpointStore, str]:
    """A Ray ``Checkpoint`` as (store of its parent directory, its name)."""
    path = PurePosixPath(checkpoint.path)
    return CheckpointStore.retrying(checkpoint.filesystem, str(path.parent)), path.name


class RunCheckpoints:
    """One worker's checkpoints of one Ray Train run, and the state that
    outlives a call: the asynchronous save in flight (at most one), the
    checkpoints Ray ever listed as registered, and whether this worker
    saved (then a restore is not the start of a worker group, and its
    reports may still be pending). The ``TrainContext`` creates it on the
    first save or restore and closes it at teardown.
    """

    def __init__(self) -> None:
        self._async = AsyncCheckpointer()
        self._pending: PendingSave | None = None
        self._seen_by_ray: set[str] = set()
        self._saved = False

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        metrics: Mapping[str, Any],
        *,
        extra_state: Mapping[str, Any] | None = None,
        strategy: str = "",
        async_save: bool = False,
    ) -> None:
        """Write a sharded checkpoint into the run's storage, commit it, then
        report it with ``metrics`` from every rank (see the module docstring).

        With ``async_save`` it returns once the state is staged in host memory;
        the write, the commit and Ray's registration follow in the background.
        Either way it first waits for the save in flight, if any."""
        store = run_store()
        self.wait_for_pending_save()
        self._saved = True
        kwargs = dict(extra_state=extra_state, strategy=strategy, on_commit=self.retain)
        if not async_save:
            name = save_sharded(store, model, optimizer, **kwargs)
            _report(metrics, store, name, ray.train.CheckpointUploadMode.NO_UPLOAD)
            return
        pending = self._pending = self._async.start(store, model, optimizer, **kwargs)

        def upload(checkpoint: ray.train.Checkpoint, _dir_name: str) -> ray.train.Checkpoint:
            pending.wait()
            return checkpoint

        _report(metrics, store, pending.name, ray.train.CheckpointUploadMode.ASYNC, upload=upload)

    def wait_for_pending_save(self) -> None:
        """Wait for this worker's asynchronous save in flight (and commit it on
        rank 0); raises what its background write raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def close(self) -> None:
        """Drop the run's state and the async-save group (teardown: Ray's
        upload thread has waited for the save in flight, if any). Local."""
        self._pending = None
        self._async.close()

    def retain(self, store: CheckpointStore, name: str) -> None:
        """Rank 0 after committing ``name``: delete complete checkpoints Ray never
        registered beyond the newest ``num_to_keep`` (see the module docstring)."""
        self._delete_unregistered(store, store.read_markers(), compute_retention_deletions)

    def clear_dead_checkpoints(
        self, store: CheckpointStore, markers: Mapping[str, str | None]
    ) -> None:
        """Rank 0 when a worker group starts, with the store's ``markers`` it
        just read: delete what Ray will never register beyond the newest
        ``num_to_keep`` complete checkpoints, and the half-written ones (see
        the module docstring)."""
        self._delete_unregistered(store, markers, compute_restart_deletions)

    def _delete_unregistered(
        self, store: CheckpointStore, markers: Mapping[str, str | None], choose_deletions
    ) -> None:
        # Ray 2.60 exposes the run config to workers only through its internal context.
        from ray.train.v2._internal.execution.context import get_train_context

        keep = get_train_context().train_run_context.run_config.checkpoint_config.num_to_keep
        # Ray writes its snapshot before deleting the checkpoints it drops: one it
        # is dropping right now is in no snapshot any more, and deleting it too
        # would make Ray's own delete fail. Anything Ray ever listed stays Ray's.
        self._seen_by_ray.update(names_in(store.read_text(_RAY_SNAPSHOT)))
        for orphan in choose_deletions(markers, self._seen_by_ray, keep):
            _logger.info("ray_fsdp_backend: deleting unregistered checkpoint %s", orphan)
            store.delete(orphan)

    def restore(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        checkpoint: ray.train.Checkpoint | None = None,
    ) -> dict[str, Any] | None:
        """Load the newest complete checkpoint of the run into ``model`` and
        ``optimizer``; without one, ``checkpoint`` (e.g. another run's, to
        fine-tune from: Train V2 dropped ``resume_from_checkpoint``) or else the
        one ``ray.train.get_checkpoint()`` hands. Returns this rank's extra state,
        or None when there is nothing to resume. Rank 0 chooses, so every rank
        loads the same checkpoint. Collective."""
        handed = checkpoint if checkpoint is not None else ray.train.get_checkpoint()
        store = run_store()

        def choose():
            with naming_store(store, "(newest complete)", "listing"):
                markers = store.read_markers()
            handed_marker = None if handed is None else _marker_of(handed)
            choice = choose_resume(markers, handed_marker, handed is not None)
            if not self._saved:
                try:
                    with naming_store(store, "(unregistered)", "clearing"):
                        self.clear_dead_checkpoints(store, markers)
                except CheckpointStorageError as exc:  # housekeeping: never stops a resume
                    _logger.warning("ray_fsdp_backend: %s", exc)
            return choice

        choice = broadcast_from_rank0(choose)
        if choice is None:
            return None
        if choice.handed:
            store, name = handed_store(handed)
        else:
            name = choice.name
        _log_choice(store, name, handed)
        return load_sharded(store, name, model, optimizer)


def _report(metrics, store: CheckpointStore, name: str, mode, upload=None) -> None:
    extra = {} if upload is None else {"checkpoint_upload_fn": upload}
    ray.train.report(
        dict(metrics),
        # Ray's own calls get the user's filesystem, not our retrying wrapper.
        checkpoint=ray.train.Checkpoint(path=store.path(name), filesystem=unwrap(store.fs)),
        checkpoint_dir_name=name,
        checkpoint_upload_mode=mode,
        delete_local_checkpoint_after_upload=False,
        **extra,
    )


def _marker_of(checkpoint: ray.train.Checkpoint) -> str | None:
    store, name = handed_store(checkpoint)
    return store.read_marker(name)


def _log_choice(store: CheckpointStore, name: str, handed) -> None:
    if dist.get_rank() != 0:
        return
    handed_name = None if handed is None else PurePosixPath(handed.path).name
    _logger.info(
        "ray_fsdp_backend: resuming from %s (Ray handed %s)", store.path(name), handed_name
    )
