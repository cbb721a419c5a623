"""PURE decisions about checkpoints: names, completeness, which one to resume,
and whether a checkpoint fits a model.

A checkpoint is a directory ``checkpoint_<seq>`` (``seq`` zero-padded, so
names sort in save order) under the run's storage directory. It is complete
once its ``COMPLETE`` marker exists, which rank 0 writes only after every rank
finished writing its shard; a directory without a readable marker is never
resumed from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MARKER_NAME = "COMPLETE"
EXTRA_DIR = "extra"
FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^checkpoint_(\d{6,})$")


def checkpoint_name(seq: int) -> str:
    """Directory name of the ``seq``-th checkpoint of a run."""
    return f"checkpoint_{seq:06d}"


def parse_seq(name: str) -> int | None:
    """The sequence number in a checkpoint directory name; None for other names."""
    match = _NAME_RE.match(name)
    return int(match.group(1)) if match else None


def next_checkpoint_name(existing: Iterable[str]) -> str:
    """A name after every checkpoint directory in ``existing``, complete or not
    (a partial directory left by a crash is never written into again)."""
    seqs = [s for s in map(parse_seq, existing) if s is not None]
    return checkpoint_name(max(seqs, default=0) + 1)


def extra_state_name(rank: int) -> str:
    """Path, inside a checkpoint, of one rank's extra state (RNG, step, data)."""
    return f"{EXTRA_DIR}/rank_{rank:05d}.pt"


def encode_marker(*, world_size: int, strategy: str, step: int | None) -> str:
    """The ``COMPLETE`` marker's text: what wrote the checkpoint, for logs and checks."""
    info = {
        "format_version": FORMAT_VERSION,
        "world_size": world_size,
        "strategy": strategy,
        "step": step,
    }
    return json.dumps(info, sort_keys=True)


def decode_marker(text: str | None) -> dict | None:
    """The marker's fields, or None when it is missing or unreadable (a marker
    cut short by a crash makes its checkpoint incomplete, not an error)."""
    if not text:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return None
    if not isinstance(info, dict) or not isinstance(info.get("world_size"), int):
        return None
    return info


def newest_complete(markers: Mapping[str, str | None]) -> str | None:
    """Of checkpoint directories (name -> marker text, None when absent), the
    newest whose marker is complete; None when there is none."""
    complete = [
        name
        for name, text in markers.items()
        if parse_seq(name) is not None and decode_marker(text) is not None
    ]
    return max(complete, key=parse_seq, default=None)


def stale_partials(markers: Mapping[str, str | None], newest: str) -> list[str]:
    """Incomplete checkpoint directories (name -> marker text) older than
    ``newest``: left by a crash during save, never registered with Ray (a
    checkpoint is reported only after its marker exists), safe to delete."""
    limit = parse_seq(newest)
    return sorted(
        name
        for name, text in markers.items()
        if (seq := parse_seq(name)) is not None and seq < limit and decode_marker(text) is None
    )


@dataclass(frozen=True)
class KeyMismatch:
    """How a model's state differs from a checkpoint's."""

    missing: tuple[str, ...]
    """Keys the model has and the checkpoint lacks."""
    unexpected: tuple[str, ...]
    """Keys the checkpoint has and the model lacks."""
    wrong_shape: tuple[tuple[str, tuple, tuple], ...]
    """``(key, model shape, checkpoint shape)`` for tensors of another size."""

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.wrong_shape)

    def describe(self, limit: int = 10) -> str:
        """One line per kind of difference, at most ``limit`` keys each."""

        def cut(items: list[str]) -> str:
            more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
            return ", ".join(items[:limit]) + more

        lines = []
        if self.missing:
            lines.append(f"missing in checkpoint: {cut(list(self.missing))}")
        if self.unexpected:
            lines.append(f"not in model: {cut(list(self.unexpected))}")
        if self.wrong_shape:
            shapes = [
                f"{key} (model {list(mine)}, checkpoint {list(theirs)})"
                for key, mine, theirs in self.wrong_shape
            ]
            lines.append(f"shape mismatch: {cut(shapes)}")
        return "; ".join(lines)


def compute_key_mismatch(
    expected: Mapping[str, tuple | None],
    stored: Mapping[str, tuple | None],
    prefixes: tuple[str, ...],
) -> KeyMismatch:
    """Compare flattened keys (-> global shape, None for non-tensors) of the
    state to load with those of a checkpoint, over the keys that start with
    one of ``prefixes``."""

    def select(d: Mapping[str, tuple | None]) -> dict[str, tuple | None]:
        return {k: v for k, v in d.items() if k.startswith(prefixes)}

    want, have = select(expected), select(stored)
    wrong = tuple(
        (k, tuple(want[k]), tuple(have[k]))
        for k in sorted(want.keys() & have.keys())
        if want[k] is not None and have[k] is not None and tuple(want[k]) != tuple(have[k])
    )
    return KeyMismatch(
        missing=tuple(sorted(want.keys() - have.keys())),
        unexpected=tuple(sorted(have.keys() - want.keys())),
        wrong_shape=wrong,
    )


@dataclass(frozen=True)
class ResumeChoice:
    """Which checkpoint a run resumes from: one of its own (``name`` in the
    run's storage) or the one Ray handed it (``handed``: e.g. a
    ``resume_from_checkpoint`` of another run)."""

    name: str | None = None
    handed: bool = False


def choose_resume(
    run_markers: Mapping[str, str | None], handed_marker: str | None, has_handed: bool
) -> ResumeChoice | None:
    """The checkpoint to resume from.

    The newest complete checkpoint in the run's own storage wins: Ray registers
    reports asynchronously, so the checkpoint it hands a restarted group can be
    older than the last one every rank completed. Without one, Ray's handed
    checkpoint is used when it is complete. None: nothing to resume.

    Raises:
        ValueError: Ray handed a checkpoint without a complete marker and the
            run has none of its own.
    """
    name = newest_complete(run_markers)
    if name is not None:
        return ResumeChoice(name=name)
    if not has_handed:
        return None
    if decode_marker(handed_marker) is None:
        raise ValueError(
            f"the checkpoint Ray handed this run has no readable {MARKER_NAME} marker: it is "
            "incomplete or was not written by TrainContext.save_checkpoint"
        )
    return ResumeChoice(handed=True)


def names_in(text: str | None) -> set[str]:
    """Every checkpoint directory name mentioned in ``text`` (e.g. Ray's
    checkpoint-manager snapshot: the checkpoints Ray has registered)."""
    return set(re.findall(r"checkpoint_\d{6,}", text or ""))


def compute_restart_deletions(
    markers: Mapping[str, str | None], ray_known: Iterable[str], num_to_keep: int | None
) -> list[str]:
    """Checkpoints to delete when a new worker group starts, before it saves.

    Ray Train discards the pending reports of a worker group it shuts down,
    so a checkpoint it has not registered by the time the next group starts
    never will be: an incomplete one is debris of a dead writer, and complete
    ones count against ``num_to_keep`` with Ray's own. Of all complete
    checkpoints the newest ``num_to_keep`` stay (so the newest complete one
    always does); of the older ones those Ray never registered are returned,
    with every incomplete one Ray never registered but the newest directory:
    its name anchors the sequence (:func:`next_checkpoint_name`), so that a
    new checkpoint never takes a name a dead writer may still be writing."""
    names = [n for n in markers if parse_seq(n) is not None]
    debris = stale_partials(markers, max(names, key=parse_seq)) if names else []
    known = set(ray_known)
    doomed = _beyond_kept(markers, num_to_keep) + debris
    return sorted((n for n in doomed if n not in known), key=parse_seq)


def compute_retention_deletions(
    markers: Mapping[str, str | None], ray_known: Iterable[str], num_to_keep: int | None
) -> list[str]:
    """Complete checkpoints to delete so that the store keeps ``num_to_keep``.

    All complete checkpoints count, registered with Ray or not; the newest
    ``num_to_keep`` stay (so the newest complete one always does). Of the
    older ones only those Ray never registered are returned (Ray deletes its
    own): and only when older than the newest one Ray registered, since Ray
    registers reports in order, a checkpoint older than a registered one
    that is not registered itself never will be (its worker died)."""
    known = {n for n in ray_known if parse_seq(n) is not None}
    if not known:
        return []
    newest_known = max(map(parse_seq, known))
    older = _beyond_kept(markers, num_to_keep)
    return [n for n in older if n not in known and parse_seq(n) < newest_known]


def _beyond_kept(markers: Mapping[str, str | None], num_to_keep: int | None) -> list[str]:
    """Complete checkpoints older than the newest ``num_to_keep``, oldest
    first (none without ``num_to_keep``)."""
    if num_to_keep is None or num_to_keep < 1:
        return []
    complete = sorted(
        (n for n, text in markers.items() if parse_seq(n) is not None and decode_marker(text)),
        key=parse_seq,
    )
    return complete[: max(len(complete) - num_to_keep, 0)]


def per_parameter_groups(keys: Iterable[str]) -> bool:
    """Whether a checkpoint (its flattened ``keys``) keeps the optimizer's
    param groups per parameter (``optim.param_groups.<fqn>.lr``), as a
    pipeline run's checkpoints do, rather than as one list
    (``optim.param_groups.0.params`` and the group's hyperparameters), which
    DCP stores once, from one rank: the stages of a pipeline hold different
    parameters, so each writes its own entries."""
    groups = [k for k in keys if k.startswith("optim.param_groups.")]
    return bool(groups) and not any(k.endswith(".params") for k in groups)
