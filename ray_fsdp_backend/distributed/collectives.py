"""Small collectives the checkpoint and Hugging Face layers share.

Read something once (on rank 0) and give every rank the same answer, or the
same error; agree on whether every rank's part of a step succeeded. Either
way no rank waits on a collective that another abandoned.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


class RankFailedError(RuntimeError):
    """Raised on every rank when the part of one or more ranks failed;
    the message names each failing rank and its error."""


def broadcast_from_rank0(compute):
    """``compute()`` on rank 0, its result on every rank (collective when a
    process group of more than one rank is up; a plain call otherwise). An
    exception on rank 0 is raised on every rank, so none waits forever."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    outcome, error = None, None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", compute())
        except Exception as exc:
            error = exc
            outcome = ("error", _picklable(exc))
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise error or value  # rank 0: its own error, traceback and all
    return value


def _picklable(error: Exception) -> Exception:
    """``error``, or a RuntimeError naming its type and message when it
    cannot be pickled: Ray's ``RayTaskError(ValueError)`` (a failing reward
    task's) is a class made at run time that pickle cannot look up (Ray 2.60),
    and the broadcast would fail with a PicklingError that hides it."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__} on rank 0: {error}")
    return error


def raise_if_any_failed(error: BaseException | None, what: str) -> None:
    """Collective: every rank passes the error its part of ``what`` raised
    (None: it succeeded). One all-reduce of one int; when some rank failed,
    their messages are gathered and every rank raises
    :class:`RankFailedError` naming them (chained to its own error, if any).
    Without a process group, ``error`` itself is raised."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl_only() else None
    failed = torch.tensor([int(error is not None)], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    named = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
    raise RankFailedError(f"{what} failed on {named}") from error


@contextlib.contextmanager
def agreed(what: str) -> Iterator[None]:
    """Collective: run the block on every rank, then agree on its outcome.

    An exception the block raises on this rank is caught, and every rank
    then takes part in :func:`raise_if_any_failed`: when the block failed on
    any rank, every rank raises :class:`RankFailedError` naming ``what``,
    each failing rank and its error (chained to this rank's own), within
    the time of one all-reduce. Ranks stay in step when a block holds its
    collective (one tensor's gather, one broadcast) first and local work
    after it: a rank that fails in the local work, or in a collective it
    has joined, meets the others at this agreement instead of leaving them
    in the next collective until the process group's timeout. (A rank that
    fails before it joins a collective leaves the others in that one: no
    process group can be interrupted from Python.)
    ``KeyboardInterrupt`` and other ``BaseException`` pass through."""
    error = None
    try:
        yield
    except RankFailedError:
        raise  # an inner phase's agreement: raised on every rank already
    except Exception as exc:
        error = exc
    raise_if_any_failed(error, what)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` on every rank (collective for a DTensor: every rank
    calls it, in the same order), a plain tensor returned as it is.

    One mesh dim at a time, as ``DTensor.full_tensor`` would, in the same
    collectives: FSDP2 over tensor parallelism places a weight
    ``(_StridedShard(0), Shard(0))``, whose two all-gathers torch cannot merge
    (the tp split is the outer one), and ``full_tensor`` warns so once per
    mesh on every rank ("2 sequential all_gather operations ... it is not
    possible to merge non-ascending order", torch 2.13 _redistribute.py)."""
    if not isinstance(t, DTensor):
        return t
    placements = list(t.placements)
    for dim, placement in enumerate(placements):
        if not placement.is_replicate():
            placements[dim] = Replicate()
            t = t.redistribute(placements=placements)
    return t.to_local()


def _nccl_only() -> bool:
    """Whether the default group carries CUDA tensors only (nccl without a
    gloo part for CPU tensors)."""
    return dist.get_backend() == "nccl"
