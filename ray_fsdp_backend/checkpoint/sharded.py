"""Sharded save and load with ``torch.distributed.checkpoint`` (no Ray here).

Model and optimizer go through ``torch.distributed.checkpoint.state_dict``
(keys are parameter FQNs without wrapper prefixes such as DDP's ``module.``),
so a checkpoint loads under another world size or strategy: DCP reshards.
Each rank also writes its own extra state (RNG generators and the caller's
step, data position, scheduler state). Rank 0 commits the checkpoint with a
``COMPLETE`` marker only after every rank finished writing.

Files go straight to the store (:mod:`.store`): each rank writes and reads
only its own files and byte ranges. :class:`AsyncCheckpointer` stages the
state in host memory and writes it in a background thread (``dcp.async_save``
on a gloo group it owns); its :class:`PendingSave` commits the checkpoint once
every rank's files are durable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ray_fsdp_backend.checkpoint.buffers import rank_buffers, restore_rank_buffers
from ray_fsdp_backend.checkpoint.extra_state import (
    encode_extra_state,
    read_extra_state,
    restore_rng_state,
)
from ray_fsdp_backend.checkpoint.fit import CheckpointMismatchError, check_fits, other_ranks_keys
from ray_fsdp_backend.checkpoint.layout import (
    encode_marker,
    extra_state_name,
    newest_complete,
    next_checkpoint_name,
    per_parameter_groups,
    stale_partials,
)
from ray_fsdp_backend.checkpoint.store import (
    CheckpointStore,
    dcp_reader,
    dcp_writer,
)
from ray_fsdp_backend.compat.peft import frozen_is_random, has_frozen_parameters
from ray_fsdp_backend.distributed.collectives import agreed, broadcast_from_rank0

_logger = logging.getLogger(__name__)

# DCP reports a rank's failed read or write as CheckpointException, a
# BaseException (torch 2.13), which ``except Exception`` misses.
_IO_ERRORS = (Exception, CheckpointException)


class CheckpointStorageError(RuntimeError):
    """Reading or writing a checkpoint on its store failed (the message names
    the store and the checkpoint, never credentials)."""


@contextlib.contextmanager
def naming_store(store: CheckpointStore, name: str, action: str) -> Iterator[None]:
    """Re-raise a failure of the block as ``CheckpointStorageError`` naming
    the store and the checkpoint (``action``: reading, writing, ...)."""
    try:
        yield
    except (CheckpointStorageError, CheckpointMismatchError):
        raise
    except _IO_ERRORS as exc:
        raise CheckpointStorageError(
            f"{action} checkpoint {name} on store {store.describe()} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def save_sharded(
    store: CheckpointStore,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    extra_state: Mapping[str, Any] | None = None,
    strategy: str = "",
    on_commit: Callable[[CheckpointStore, str], None] | None = None,
) -> str:
    """Write a new checkpoint into ``store`` and commit it; returns its name.

    Collective: every rank calls it. Each rank writes its DCP shard and its
    extra state straight into the store; after a barrier rank 0 writes the
    ``COMPLETE`` marker, deletes partial checkpoints older than this one and
    calls ``on_commit(store, name)`` (retention). When it returns on any
    rank, the checkpoint is complete.

    Raises:
        ValueError: ``extra_state`` holds objects that ``torch.load(...,
            weights_only=True)`` cannot read back (checked before writing).
        CheckpointStorageError: the store failed; the message names it.
    """
    name = _begin_save(store, extra_state, model)
    with naming_store(store, name, "writing"):
        dcp.save(_state_to_save(model, optimizer), storage_writer=dcp_writer(store, name))
    dist.barrier()
    if dist.get_rank() == 0:
        _commit(store, name, extra_state, strategy, on_commit)
    dist.barrier()
    return name


def _begin_save(
    store: CheckpointStore, extra_state: Mapping[str, Any] | None, model: nn.Module
) -> str:
    """Agree on the new checkpoint's name and write this rank's extra state
    (with its own buffers: DCP keeps one copy of a plain tensor)."""
    payload = encode_extra_state(extra_state, rank_buffers(model))
    with naming_store(store, "(new)", "naming"):
        name = broadcast_from_rank0(lambda: next_checkpoint_name(store.list_checkpoints()))
    with naming_store(store, name, "writing"):
        store.write_file(f"{name}/{extra_state_name(dist.get_rank())}", payload)
    return name


def _commit(store, name, extra_state, strategy, on_commit) -> None:
    """Rank 0, once every rank's files are durable: marker, then cleanup."""
    step = (extra_state or {}).get("step")
    marker = encode_marker(
        world_size=dist.get_world_size(),
        strategy=strategy,
        step=step if isinstance(step, int) else None,
    )
    with naming_store(store, name, "committing"):
        commit_checkpoint(store, name, marker)
        if on_commit is not None:
            on_commit(store, name)


class PendingSave:
    """A checkpoint being written in the background (see :class:`AsyncCheckpointer`)."""

    def __init__(self, store: CheckpointStore, name: str, future: Future, commit: Callable):
        self.store, self.name = store, name
        self._future, self._commit = future, commit
        self._done = False
        # Ray's upload thread and the next save in the training thread may both wait.
        self._lock = threading.Lock()

    def wait(self) -> str:
        """Block until this rank's files are written; on rank 0 (whose DCP
        save ends only after every rank's writes were gathered and the
        metadata written) commit the checkpoint. Returns its name. Raises
        ``CheckpointStorageError`` when the background write failed (the
        checkpoint then stays uncommitted). Idempotent."""
        with self._lock:
            if not self._done:
                with naming_store(self.store, self.name, "writing"):
                    self._future.result()
                if dist.get_rank() == 0:
                    self._commit()
                self._done = True
        return self.name


class AsyncCheckpointer:
    """Writes checkpoints in the background (``dcp.async_save``) on a gloo
    process group of its own, which it owns.

    ``dcp.async_save`` needs a CPU group, and one apart from training's keeps
    the background write's collectives off the training ones. The group
    belongs to the default process group it was created under: after
    ``destroy_process_group`` and a new ``init_process_group`` (a notebook
    or a torchrun script that re-initialises), ``start`` creates a new one
    instead of using a destroyed group. Call ``close`` when done (after
    waiting for the last ``PendingSave``).
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._world: dist.ProcessGroup | None = None  # the default group _group belongs to

    def start(
        self,
        store: CheckpointStore,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        extra_state: Mapping[str, Any] | None = None,
        strategy: str = "",
        on_commit: Callable[[CheckpointStore, str], None] | None = None,
    ) -> PendingSave:
        """Stage model and optimizer state in host memory and write the new
        checkpoint in a background thread; returns when the state is staged.
        The caller waits for the previous ``PendingSave`` first: one save in
        flight. Collective."""
        group = self._process_group()
        name = _begin_save(store, extra_state, model)
        future = dcp.async_save(
            _state_to_save(model, optimizer),
            storage_writer=dcp_writer(store, name),
            process_group=group,
        )
        return PendingSave(
            store, name, future, lambda: _commit(store, name, extra_state, strategy, on_commit)
        )

    def close(self) -> None:
        """Destroy the group (when its default group is still the current
        one: destroying that destroys it too). Local; idempotent."""
        if self._group is not None and self._world is dist.group.WORLD:
            dist.destroy_process_group(self._group)
        self._group = self._world = None

    def _process_group(self) -> dist.ProcessGroup:
        """This checkpointer's gloo group under the current default group,
        created on first use and again after the default group was replaced
        (collective then)."""
        world = dist.group.WORLD
        if self._group is None or self._world is not world:
            self._group, self._world = dist.new_group(backend="gloo"), world
        return self._group


def commit_checkpoint(store: CheckpointStore, name: str, marker: str) -> None:
    """Rank 0: mark ``name`` complete, then drop older partial checkpoints."""
    store.write_marker(name, marker)
    for partial in stale_partials(store.read_markers(), name):
        _logger.info("ray_fsdp_backend: deleting partial checkpoint %s", partial)
        store.delete(partial)


def load_sharded(
    store: CheckpointStore,
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    """Load checkpoint ``name`` into ``model`` and ``optimizer`` (resharding as
    needed) and restore this rank's RNG generators; returns the extra state
    this rank saved (rank 0's when this rank did not exist then).

    Collective: every rank calls it with the same ``name``.

    A model with frozen parameters (a PEFT model's base) loads only its
    trainable parameters, their optimizer state and buffers: the frozen base
    must already hold its pretrained weights (``load_pretrained``).

    Raises:
        CheckpointMismatchError: keys missing from or extra in the checkpoint,
            tensors of another shape (naming adapter ranks and targets when
            the adapters differ), or a frozen base that was initialised at
            random and never loaded.
    """
    if frozen_is_random(model):
        raise CheckpointMismatchError(
            f"checkpoint {store.path(name)} holds only the trainable parameters, but the "
            "model's frozen base was initialised at random and never loaded: call "
            "load_pretrained(model, <base checkpoint>) before restoring"
        )
    reader = dcp_reader(store, name)
    with naming_store(store, name, "reading"):
        metadata = reader.read_metadata()
        flat = per_parameter_groups(metadata.state_dict_metadata)
        state = _state_to_load(model, optimizer, flat=flat)
        check_fits(state, metadata, where=store.path(name), others=other_ranks_keys(state))
        dcp.load(state, storage_reader=reader)
        with agreed(f"reading the extra state of {name}"):  # a torn file fails every rank
            extra, own = read_extra_state(store, name, dist.get_rank())
    _set_state(model, optimizer, state, flat=flat)
    if own:
        restore_rng_state(extra["rng"])
        restore_rank_buffers(model, extra.get("buffers", {}))
    return dict(extra["user"])


def find_latest(store: CheckpointStore) -> str | None:
    """The newest complete checkpoint in ``store``; None when there is none."""
    return newest_complete(store.read_markers())


# -- model and optimizer state ------------------------------------------


def _state_options(model: nn.Module, flat: bool) -> StateDictOptions:
    """Frozen parameters (a PEFT base, loaded from its own checkpoint) stay out
    of checkpoints; keys are checked before a load, so strict is not needed.
    ``flat``: the optimizer's param groups per parameter (see
    :func:`per_parameter_groups`)."""
    frozen = has_frozen_parameters(model)
    return StateDictOptions(
        ignore_frozen_params=frozen, strict=not frozen, flatten_optimizer_state_dict=flat
    )


def is_pipeline_stage(model: nn.Module) -> bool:
    """Whether ``model`` is one pipeline stage (``pipeline.split`` cut it)."""
    return getattr(model, "pipeline_plan", None) is not None


def _state_to_save(model: nn.Module, optimizer, flat: bool | None = None) -> dict[str, Any]:
    """Model and optimizer state by parameter name; ``flat`` (default: for a
    pipeline stage) keeps param groups per parameter."""
    flat = is_pipeline_stage(model) if flat is None else flat
    optimizers = [optimizer] if optimizer is not None else []
    fresh = optimizer is not None and not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_state_options(model, flat))
    if fresh:
        # get_state_dict initialises a fresh optimizer's state with one lr-0 step
        # on zero gradients (torch 2.13): its moments stay zero but step counts
        # become 1, which would change the next real step's bias correction.
        _reset_step_counts(optimizer.state.values())
        _reset_step_counts(_optimizer_states(optim_sd))
    return {"model": model_sd, "optim": optim_sd} if optimizers else {"model": model_sd}


def _reset_step_counts(states) -> None:
    """Step counters of optimizer states back to 0, as before any step."""
    for state in states:
        step = state.get("step") if isinstance(state, Mapping) else None
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


# A fresh optimizer has no state yet; get_state_dict initialises it (a zero-lr
# step on zero gradients), so DCP has tensors to load the moments into.
_state_to_load = _state_to_save


def _optimizer_states(optim_sd: Mapping[str, Any]) -> list:
    """The per-parameter state dicts of ``optim_sd``, nested or flattened
    (``state.<fqn>.step`` keys: then one-entry dicts that share the tensors)."""
    if "state" in optim_sd:
        return list(optim_sd["state"].values())
    return [
        {"step": v} for k, v in optim_sd.items() if k.startswith("state.") and k.endswith(".step")
    ]


def _set_state(model: nn.Module, optimizer, state: dict[str, Any], flat: bool) -> None:
    optimizers = [optimizer] if optimizer is not None else []
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=_state_options(model, flat),
    )
