"""Newton–Schulz orthogonalisation, batched over matrices of one shape.

The iteration, its coefficients and its epsilon are those of
``torch.optim.Muon`` (``torch/optim/_muon.py``, from Keller Jordan's Muon);
the only differences are a leading batch dimension, so that one owner
orthogonalises all its matrices of one shape in one call, and a ``dtype``
argument: torch's function always works in bfloat16, fp32 gives an exact
reference for tests. ``zeropower_via_newtonschulz_split`` runs the same
iteration on a matrix split over a team of ranks (see its docstring).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

from ray_fsdp_backend.dmuon.plan import row_range

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
NS_STEPS = DEFAULT_NS_STEPS
NS_EPS = EPS


def zeropower_via_newtonschulz(
    matrices: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximately orthogonalise each matrix of a ``(batch, rows, cols)``
    stack: ``U S' V^T`` with ``S'`` near 1, for ``U S V^T`` its SVD.

    Each matrix is cast to ``dtype``, transposed when it has more rows than
    columns, scaled to unit Frobenius norm (at least ``eps``), and put through
    ``steps`` quintic iterations ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T``, exactly as ``torch.optim.Muon`` does for one matrix.

    Returns the stack in ``dtype``, shaped like ``matrices``.

    Raises:
        ValueError: ``matrices`` is not 3-D, or the coefficients are not three.
    """
    if matrices.ndim != 3:
        raise ValueError(f"expected a (batch, rows, cols) stack, got shape {tuple(matrices.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients={coefficients!r} must be three numbers (a, b, c)")
    a, b, c = coefficients
    x = matrices.to(dtype)
    # Normalise before transposing: the same values, but a norm over the
    # transposed view walks memory across rows (4x slower on CPU, measured);
    # in place when the cast already copied, as torch's ``div_``.
    norm = x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    x = x / norm if x is matrices else x.div_(norm)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = _add_product(x, poly, a)
    return x.mT if tall else x


def _add_product(x: torch.Tensor, poly: torch.Tensor, a: float) -> torch.Tensor:
    """``a x + poly @ x``, batched. ``x`` is a transposed view in the first
    step on tall matrices, which CPU ``baddbmm`` copies element by element
    (20% slower than the product itself at 2048 x 512); 2-D ``addmm``, as
    ``torch.optim.Muon`` calls it, takes the view as it is, with the same
    bits."""
    if x.is_contiguous() or x.device.type != "cpu":
        return torch.baddbmm(x, poly, x, beta=a)
    out = x.new_empty(x.shape)
    for x_i, poly_i, out_i in zip(x, poly, out, strict=True):
        torch.addmm(x_i, poly_i, x_i, beta=a, out=out_i)
    return out


def zeropower_via_newtonschulz_split(
    pieces: torch.Tensor,
    team: Team,
    tall: bool,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``zeropower_via_newtonschulz`` of a stack of matrices split over a
    team: each member passes its slices of their longer side (row slices of
    ``tall`` matrices, column slices otherwise) and gets the same slices of
    the result. Every member must call this with the same batch and steps.

    With ``X`` the (transposed if tall) matrix and ``X_j`` a member's column
    slice, the iteration ``X <- a X + (b A + c A^2) X`` splits by columns
    except for ``A = X X^T = sum_j X_j X_j^T``: one all-reduce of the
    ``m x m`` Gram matrix per step (and one of the squared norms first).
    Each member then forms its ``torch.chunk`` rows of ``b A + c A^2``, the
    team all-gathers them, and each updates its slice. The products and
    their association are torch's, so bf16 rounds as the whole iteration
    does; only the Gram matrix is a sum of bf16 partials. (Associating as
    ``a X + b A X + c A (A X)`` avoids the all-gather but rounds ``A X``
    once more: twice torch's bf16 error, measured on gloo ranks.)
    """
    a, b, c = coefficients
    x = pieces.to(dtype)
    squares = x.float().square().sum(dim=(-2, -1))
    team.all_reduce(squares)
    x = x / squares.sqrt().to(dtype).clamp(min=eps)[:, None, None]
    if tall:
        x = x.mT
    m = x.size(-2)
    start, stop = row_range(m, team.size, team.rank)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        team.all_reduce(gram)
        rows = gram[:, start:stop]
        poly = team.all_gather_rows(torch.baddbmm(rows, rows, gram, beta=b, alpha=c), m)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


class Team(Protocol):
    """The collectives of the ranks that share a split matrix (see
    :class:`ray_fsdp_backend.dmuon.exchange.Team`)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather_rows(self, rows: torch.Tensor, total: int) -> torch.Tensor: ...
