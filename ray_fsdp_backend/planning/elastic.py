"""PURE arithmetic of elastic runs: the global batch over whatever world Ray gives.

An elastic run (``ScalingConfig(num_workers=(min, max))``) restarts its worker
group with a different number of ranks when nodes leave or come back. The
training must not notice: every optimizer step still consumes
``global_batch_size`` samples. :func:`split_global_batch` turns that number
and the data-parallel size of the current (re)start into a per-rank
micro-batch and a number of gradient-accumulation steps.

The rule is exact, never rounded: ``global_batch_size`` must be a multiple of
the data-parallel size, and the per-rank share is cut into the fewest equal
micro-batches no larger than ``max_micro_batch_size``. A global batch that a
world size cannot split raises ``ValueError`` at the start of the attempt,
naming the sizes that would work; :func:`elastic_world_sizes` lets ``plan``
and ``validate`` report them before anything starts.

Nothing here imports torch, Ray or the rest of the package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's ``global_batch_size`` samples are read."""

    global_batch_size: int
    dp_size: int
    micro_batch_size: int
    """Samples per rank per forward/backward."""
    grad_accum: int
    """Micro-batches per rank per optimizer step."""

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch_size} = {self.dp_size} ranks x "
            f"{self.grad_accum} micro-batch(es) x {self.micro_batch_size} samples"
        )


def split_global_batch(
    global_batch_size: int, dp_size: int, max_micro_batch_size: int
) -> BatchSplit:
    """The per-rank micro-batch and accumulation steps for ``dp_size`` ranks.

    ``grad_accum`` is the smallest count that divides the per-rank share
    ``global_batch_size / dp_size`` into micro-batches of at most
    ``max_micro_batch_size`` samples.

    Raises:
        ValueError: a non-positive argument, or ``global_batch_size`` not a
            multiple of ``dp_size``.
    """
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("dp_size", dp_size),
        ("micro_batch_size", max_micro_batch_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if global_batch_size % dp_size:
        raise ValueError(
            f"train.global_batch_size={global_batch_size} cannot be split evenly over "
            f"{dp_size} data-parallel ranks (it must be a multiple of the world size); "
            f"world sizes that work: {divisors(global_batch_size)}"
        )
    share = global_batch_size // dp_size
    accum = -(-share // max_micro_batch_size)
    while share % accum:
        accum += 1
    return BatchSplit(global_batch_size, dp_size, share // accum, accum)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def elastic_world_sizes(
    global_batch_size: int | None, min_workers: int, max_workers: int, group: int = 1
) -> tuple[list[int], list[int]]:
    """World sizes in ``[min_workers, max_workers]`` an elastic run can and
    cannot restart at: ``(fits, refused)``.

    ``group`` is the model-parallel group (``tensor_parallel_size x
    context_parallel_size``): its ranks sit inside one node, so a world size
    fits only as a multiple of it (on nodes whose worker counts are multiples
    of it; the backend refuses other nodes at start, naming their counts), and
    the data-parallel size ``world / group`` must divide ``global_batch_size``
    (None: any)."""
    sizes = range(min_workers, max_workers + 1)
    fits = [n for n in sizes if _fits(n, global_batch_size, group)]
    return fits, [n for n in sizes if n not in fits]


def _fits(world: int, global_batch_size: int | None, group: int) -> bool:
    if world % group:
        return False
    return global_batch_size is None or global_batch_size % (world // group) == 0


def describe_group_sizes(
    min_workers: int, max_workers: int, group: int, label: str | None = None
) -> str | None:
    """Why ``[min_workers, max_workers]`` cannot hold a whole model-parallel
    group of ``group`` ranks, naming the counts that would; None when it can.
    ``label`` names the settings that make the group (e.g.
    ``distributed.tensor_parallel_size=4``), first in the message."""
    fits, _ = elastic_world_sizes(None, min_workers, max_workers, group)
    if fits:
        return None
    nearest = sorted({group * max(1, min_workers // group), group * -(-max_workers // group)})
    workers = min_workers if min_workers == max_workers else [min_workers, max_workers]
    what = f"{label} needs" if label else "a tensor x context parallel group needs"
    return (
        f"{what} {group} ranks per group, but scaling.num_workers={workers} holds no whole "
        f"group: worker counts must be multiples of {group} "
        f"(e.g. {', '.join(map(str, nearest))})"
    )


def worker_range(num_workers: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """``scaling.num_workers`` as ``(min, max)``; an int is a fixed size.

    Raises:
        ValueError: not a positive int or a ``[min, max]`` pair with
            ``1 <= min <= max``.
    """
    if isinstance(num_workers, int) and not isinstance(num_workers, bool):
        pair = (num_workers, num_workers)
    elif isinstance(num_workers, (list, tuple)) and len(num_workers) == 2:
        pair = tuple(num_workers)
    else:
        pair = None
    if pair is None or not all(isinstance(n, int) and not isinstance(n, bool) for n in pair):
        raise ValueError(
            f"num_workers={num_workers!r} must be a positive int or [min, max] (elastic)"
        )
    if not 1 <= pair[0] <= pair[1]:
        raise ValueError(
            f"num_workers={num_workers!r} must be a positive int or [min, max] with 1 <= min <= max"
        )
    return pair
