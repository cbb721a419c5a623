"""Newton–Schulz orthogonalisation, batched over matrices of one shape.

The iteration, its coefficients and its epsilon are those of
``torch.optim.Muon`` (``torch/optim/_muon.py``, from Keller Jordan's Muon);
the only differences are a leading batch dimension, so that one owner
orthogonalises all its matrices of one shape in one call, and a ``dtype``
argument: torch's function always works in bfloat16, fp32 gives an exact
reference for tests.
"""

from __future__ import annotations

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

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
