"""What ``ray-fsdp plan`` says about DMuon beyond the owners
(:func:`~ray_fsdp_backend.dmuon.plan.format_ns_schedule`): the traffic tensor
parallelism adds and the expert stacks' work. Pure arithmetic on shapes: no
torch, so that ``plan`` of the example decoder imports none."""

from __future__ import annotations

from collections.abc import Sequence

from ray_fsdp_backend.dmuon.plan import ns_cost


def format_tp_traffic(
    matrices: Sequence[tuple[int, int]], tp: int, num_ranks: int, itemsize: int = 2
) -> list[str]:
    """``ray-fsdp plan``'s line on what TP adds to DMuon per step: the TP
    blocks each owner gathers (``matrices`` are whole shapes, ``num_ranks``
    the owners' group, ``itemsize`` the bytes of ``ns_dtype``) and the
    Newton–Schulz repeated on every rank of a tp group."""
    if tp == 1 or not matrices:
        return []
    gathered = sum(rows * cols for rows, cols in matrices) * (tp - 1) / tp / num_ranks
    return [
        f"  tp {tp}           owners all-gather the other TP blocks of their matrices: "
        f"{gathered * itemsize / 2**20:,.1f} MiB per rank per step in bf16 (inside a node); "
        f"Newton–Schulz runs on each of the {tp} ranks of a tp group"
    ]


def format_stack_lines(stacks: Sequence[tuple[int, int, int]], ep: int, efsdp: int) -> list[str]:
    """``ray-fsdp plan``'s line on DMuon's stacked (expert) matrices:
    orthogonalised where they live (``ep`` x ``efsdp`` ranks split each
    stack by expert), so no exchange, and the Newton–Schulz work per rank."""
    if not stacks:
        return []
    count = sum(n for n, _, _ in stacks)
    held = [-(-(n // ep) // efsdp) for n, _, _ in stacks]  # torch.chunk of n / ep over efsdp
    total, busiest = (
        2 * sum(k * ns_cost((r, c)) for k, (_, r, c) in zip(ks, stacks, strict=True)) / 1e12
        for ks in ([n for n, _, _ in stacks], held)
    )
    return [
        f"  experts        {count:,} expert matrices in {len(stacks)} stacks, {total:,.2f} "
        f"TFLOP per step ({busiest:,.2f} on the busiest rank), each orthogonalised by the "
        f"rank holding it (ep={ep} x efsdp={efsdp} split every stack by expert, at most "
        f"{max(held)} of a stack per rank): no exchange, 0 B over ep or efsdp",
    ]
