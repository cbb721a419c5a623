"""NF4's block sizes and the rule its shards must meet, as plain arithmetic:
what ``plan`` and ``validate`` check before any worker starts, without the
torch that :mod:`ray_fsdp_backend.ops.quantization` (the quantiser) imports."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 64
"""Values per NF4 block (one absmax scale each): ``to_nf4``'s ``block_size``."""
SCALER_BLOCK = 256
"""Block scales per second-level block (one fp32 factor each)."""
SHARD_MULTIPLE = BLOCK * SCALER_BLOCK


def nf4_bytes_per_param(base_itemsize: int = 2) -> float:
    """Bytes per quantised parameter: 4-bit codes, an int8 scale per block of
    64 and a factor per 64 x 256 in the base's dtype (bf16: 0.5157)."""
    return 0.5 + 1 / BLOCK + base_itemsize / SHARD_MULTIPLE


QUANTIZATIONS = ("nf4",)


@dataclass(frozen=True)
class Target:
    """One weight to quantise: its name, global shape and this rank's shard shape."""

    name: str
    shape: tuple[int, ...]
    shard: tuple[int, ...]
    shards: int


def check_quantize(quantize: str) -> None:
    """Raise ``ValueError`` for a quantisation other than ``"nf4"``."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantize!r} is not one of {', '.join(QUANTIZATIONS)}")


def check_nf4_shards(targets: list[Target]) -> None:
    """Refuse weights whose shards NF4 cannot quantise bitwise as the whole (PURE).

    Each weight must split evenly into its shards along dim 0, and each
    shard must hold a multiple of 64 x 256 = 16384 elements.

    Raises:
        ValueError: naming every such weight, its shape, the shard's shape
            and what does not divide.
    """
    bad = nf4_shard_problems(targets)
    if bad:
        raise ValueError(
            f"quantize='nf4' cannot quantise {len(bad)} weights shard by shard: "
            + "; ".join(bad)
            + " (choose dimensions or a shard count that divide them)"
        )


def nf4_shard_problems(targets: list[Target]) -> list[str]:
    """One line per target :func:`check_nf4_shards` refuses, naming its shape
    and what does not divide (PURE; the static check prints them one a line)."""
    bad = []
    for t in targets:
        numel = 1
        for n in t.shard:
            numel *= n
        if t.shape[0] % t.shards:
            bad.append(f"{t.name} {list(t.shape)}: dim 0 ({t.shape[0]}) over {t.shards} shards")
        elif numel % SHARD_MULTIPLE:
            bad.append(
                f"{t.name} {list(t.shape)}: shard {list(t.shard)} holds {numel} elements, "
                f"not a multiple of block {BLOCK} x scaler block {SCALER_BLOCK} "
                f"= {SHARD_MULTIPLE}"
            )
    return bad
