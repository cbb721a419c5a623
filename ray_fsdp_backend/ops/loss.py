"""Cross-entropy of ``hidden @ weight.T`` that never holds the whole logits.

At a large vocabulary the logits dominate a step's memory: 8 x 4096 tokens
of Qwen3 (151,936 words) are 19.9 GB in fp32, their gradient as much
again. :func:`linear_cross_entropy` computes the same loss over chunks of
tokens: forward keeps one chunk's logits at a time and saves only each
token's log-sum-exp; backward recomputes each chunk's logits and turns them
into that chunk's gradients at once (torchtune's chunked loss and Cut
Cross-Entropy work the same way, in plain torch: no Triton). The transient
memory is ``chunk x vocab`` fp32 logits plus their softmax, not
``tokens x vocab``.

The kernel computes each token's ``log-sum-exp - target logit`` and its
backward takes a per-token gradient: :func:`linear_token_log_probs` is minus
those values (the per-token log-probs a preference loss sums per sequence,
with a sampling ``temperature``), :func:`linear_cross_entropy` their sum.
With ``entropy=True`` the same pass also gives each token's entropy of the
(tempered) distribution, ``lse - sum_v softmax_v * z_v``: per chunk, with
``d = z - max``, it is ``log S - T / S`` for ``S = sum exp(d)`` and
``T = sum exp(d) * d``, sums that add over vocabulary slices as the
log-sum-exp's do (:func:`_exp_moments`), so no ``[tokens, vocab]`` tensor is
held and a tp head all-reduces ``T`` in the same call as ``S``.

Labels are the targets of the rows of ``hidden`` as they are: label ``i``
is the token that row ``i`` predicts, already shifted (the trainer's
``targets``, what ``ctx.shard_sequence`` produces from transformers-style
``labels``). Nothing is shifted here.

Under tensor parallelism the head's weight is a ``Shard(0)`` DTensor over
the vocabulary: each tp rank computes its vocabulary slice's logits, and
the log-sum-exp is assembled with one all-reduce of the maxima and one of
the exp-sums (stacked with the target logits) per chunk, as torch's
``loss_parallel`` does; the hidden states' gradient is summed over the tp
ranks in backward.

With ``compile=True`` the per-chunk math (the chunk's logits, soft-cap,
log-sum-exp and target logit in forward; softmax minus one-hot and the
hidden states' matmul in backward) runs through ``torch.compile``, one
compiled function each for forward and backward; the autograd function,
the chunk loop, the weight gradient's accumulation and the tp all-reduces
stay eager. Full chunks compile with static shapes; the last, shorter chunk
of a call makes dynamo mark the token dimension dynamic, so remainders of
other lengths reuse that graph (``dynamic=None``, torch's automatic dynamic
shapes; a 1-token remainder is specialised once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ray_fsdp_backend.planning.memory import DEFAULT_CHUNK_TOKENS
from ray_fsdp_backend.planning.topology import TP_AXIS

REDUCTIONS = ("sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "sum",
    chunk_size: int | None = None,
    softcap: float | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), labels)`` without the
    whole ``[tokens, vocab]`` logits.

    The logits of ``chunk_size`` tokens at a time are computed in the
    inputs' dtype (a bf16 matmul accumulates in fp32) and turned to fp32
    before the soft-cap, softmax and log-sum-exp; backward recomputes them
    chunk by chunk. The weight's gradient is accumulated in fp32 over the
    chunks and returned in its dtype. The loss is minus the sum of
    :func:`linear_token_log_probs` (one kernel: per-token values whose
    backward takes a per-token gradient).

    Args:
        hidden: ``[..., dim]`` final hidden states (after the last norm).
        weight: ``[vocab, dim]`` output head weight (tied or not); a
            ``Shard(0)`` DTensor over a 1-D ``tp`` mesh computes
            vocabulary-parallel; a DTensor split over any other mesh axis (an
            FSDP-sharded head) is refused.
        labels: ``[...]`` target token per row of ``hidden``, already
            shifted; ``ignore_index`` rows count for nothing.
        ignore_index: label value that takes no loss.
        reduction: ``sum`` (over valid tokens) or ``mean`` (over valid tokens);
            a ``mean`` over no valid token is 0 with zero gradients (a
            prompt-only micro-batch adds nothing to the step; ``F.cross_entropy``
            gives the same zero gradients but a NaN value).
        chunk_size: tokens per chunk (None: :data:`DEFAULT_CHUNK_TOKENS`).
        softcap: Gemma 2's final logit soft-cap ``c * tanh(logits / c)``.
        compile: run each chunk's forward and backward math through
            ``torch.compile`` (inductor; a C++ compiler on CPU); the same
            numbers as eager within fp32 rounding.

    Returns:
        A 0-d fp32 tensor.

    Raises:
        ValueError: a reduction not in ``sum``/``mean``, a chunk size below 1,
            mismatched shapes, or a weight split over a mesh axis not ``tp``.
        RuntimeError: a label outside ``[0, vocab)`` that is not
            ``ignore_index`` (``F.cross_entropy`` raises too). The check is
            ``torch._assert_async``: on CPU it raises here; on CUDA it is a
            device-side assert, with no host sync.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")
    total, _ = _token_losses(
        hidden, weight, labels, ignore_index, chunk_size, softcap, 1.0, compile
    )
    total = total.sum()
    if reduction == "sum":
        return total
    # At least 1: no valid token gives 0 / 1 (zero gradients), not 0 / 0 (NaN).
    return total / (labels != ignore_index).sum().clamp_min(1)


def linear_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
    compile: bool = False,
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability of its target,
    ``log_softmax(logits / temperature).gather(-1, targets)`` with
    ``logits = softcap(hidden @ weight.T)`` in fp32, without the whole
    ``[tokens, vocab]`` logits.

    The same chunked kernel as :func:`linear_cross_entropy` (which is minus
    this function's sum): forward keeps one chunk's logits at a time and saves
    each token's log-sum-exp; backward takes a per-token gradient and
    recomputes each chunk's logits. ``temperature`` divides the soft-capped
    logits, as vLLM's sampler does, so a policy's log-probs match the
    sampler's. Under a tp ``Shard(0)`` head the vocabulary is split as in
    :func:`linear_cross_entropy`; every tp rank gets every token's value.

    Args:
        hidden: ``[..., dim]`` final hidden states (after the last norm).
        weight: ``[vocab, dim]`` output head weight (see
            :func:`linear_cross_entropy`).
        targets: ``[...]`` target token per row of ``hidden``, already
            shifted; ``ignore_index`` rows get 0 and no gradient.
        ignore_index: target value that takes no log-probability.
        chunk_size: tokens per chunk (None: :data:`DEFAULT_CHUNK_TOKENS`).
        softcap: Gemma 2's final logit soft-cap ``c * tanh(logits / c)``.
        temperature: a positive divisor of the (soft-capped) logits.
        compile: run each chunk's math through ``torch.compile``.
        entropy: also return each token's entropy of
            ``softmax(logits / temperature)`` (the module docstring: the same
            chunks, one more row sum per chunk and, under tp, in the same
            all-reduce); 0 where the target is ignored; not differentiable.
            The chunk then holds a second ``chunk x vocab`` fp32 buffer.

    Returns:
        fp32 ``[...]`` (``targets``' shape), differentiable in ``hidden`` and
        ``weight``; with ``entropy``, ``(log_probs, entropies)`` of that shape.

    Raises:
        ValueError: a chunk size below 1, a temperature not above 0,
            mismatched shapes, or a weight split over a mesh axis not ``tp``.
        RuntimeError: a target outside ``[0, vocab)`` that is not
            ``ignore_index`` (see :func:`linear_cross_entropy`).
    """
    _check_temperature(temperature)
    losses, entropies = _token_losses(
        hidden, weight, targets, ignore_index, chunk_size, softcap, float(temperature), compile,
        entropy,
    )  # fmt: skip
    log_probs = losses.neg().view(targets.shape)
    return (log_probs, entropies.view(targets.shape)) if entropy else log_probs


def logits_token_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits.float() / temperature).gather(-1, targets)``, 0
    where ``targets == ignore_index``: the per-token log-probs of whole
    ``[..., vocab]`` logits (a model whose head the fused kernel cannot take;
    the tests' reference). A DTensor ``logits`` (a tp head's vocabulary
    slices) is gathered whole first. With ``entropy``, also each token's
    ``-(softmax * log_softmax).sum(-1)`` (0 where ignored, no gradient), as
    :func:`linear_token_log_probs` returns them."""
    _check_temperature(temperature)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    valid = targets != ignore_index
    picked = log_probs.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(valid, picked, 0.0)
    if not entropy:
        return picked
    with torch.no_grad():
        entropies = -(log_probs.exp() * log_probs).sum(-1)
    return picked, torch.where(valid, entropies, 0.0)


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, bool) or not float(temperature) > 0:
        raise ValueError(f"temperature={temperature!r} must be a number above 0")


def _token_losses(
    hidden, weight, labels, ignore_index, chunk_size, softcap, temperature, compile, entropy=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``lse - target logit`` (fp32 ``[tokens]``, 0 where
    ignored) and, with ``entropy``, its entropy (else an empty tensor)
    through :class:`_ChunkedTokenLosses`, after the checks both public
    functions share."""
    chunk = DEFAULT_CHUNK_TOKENS if chunk_size is None else chunk_size
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int or None")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)}: labels must be "
            "hidden's shape without its last dim (one target per row, already shifted)"
        )
    _assert_labels_in_vocabulary(labels, weight.shape[0], ignore_index)
    hidden, weight, group, vocab_start = _local_operands(hidden, weight)
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden dim {hidden.shape[-1]} != weight dim {weight.shape[-1]}")
    return _ChunkedTokenLosses.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        (ignore_index, vocab_start, softcap, temperature),
        chunk,
        group,
        _kernels(compile),
        entropy,
    )


def _assert_labels_in_vocabulary(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every label is a word of the (whole) vocabulary or ``ignore_index``:
    a label past it would otherwise be scored against no logit at all."""
    in_range = ((labels >= 0) & (labels < vocab)) | (labels == ignore_index)
    torch._assert_async(
        in_range.all(),
        f"labels must lie in [0, {vocab}) (the head's vocabulary) or equal "
        f"ignore_index={ignore_index}",
    )


def _local_operands(hidden: torch.Tensor, weight: torch.Tensor):
    """Plain tensors for the kernel, with the tp group and this rank's first
    word when the weight is split over the vocabulary (else None, 0).

    A DTensor ``hidden`` (a tp head's input, made ``Replicate``) becomes its
    local tensor; its gradient, summed over tp here, is Replicate too."""
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(hidden.device_mesh, [Replicate()]).to_local()
    if not isinstance(weight, DTensor):
        return hidden, weight, None, 0
    _refuse_split_outside_tp(weight)
    mesh, placements = weight.device_mesh, weight.placements
    if mesh.ndim != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        return hidden, weight.full_tensor(), None, 0
    vocab, size, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    if vocab % size:
        raise ValueError(f"vocabulary {vocab} is not a multiple of the tp size {size}")
    return hidden, weight.to_local(), mesh.get_group(), rank * (vocab // size)


def _refuse_split_outside_tp(weight: DTensor) -> None:
    """A weight split over a mesh axis other than ``tp`` is refused: an
    FSDP-sharded head (its unit resharded after forward) is ``Shard(0)`` on
    a 1-D dp mesh too, and taken for a vocabulary split it gave every rank a
    wrong loss; gathered here, its gradient would bypass FSDP's reduction."""
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    split = [
        name
        for axis, (name, placement) in enumerate(zip(names, weight.placements, strict=True))
        if not placement.is_replicate() and mesh.size(axis) > 1  # a 1-rank axis splits nothing
    ]
    if any(name != TP_AXIS for name in split):
        raise ValueError(
            f"weight is a DTensor split over mesh axes {split} "
            f"(placements {tuple(weight.placements)}): linear_cross_entropy splits the "
            f"vocabulary only over a 1-D {TP_AXIS!r} mesh. An FSDP-sharded head must be "
            "gathered when the loss runs: keep its unit gathered after forward "
            "(set_reshard_after_forward(False)), as the trainer does"
        )


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, softcap, temperature) -> torch.Tensor:
    """One chunk's fp32 (capped, tempered) logits: the matmul in the inputs' dtype."""
    z = _capped((h @ w.T).float(), softcap)
    return z if temperature == 1.0 else z / temperature


def _logits_peak(h, w, labels, ignore_index: int, vocab_start: int, softcap, temperature):
    """One chunk's fp32 logits over this rank's vocabulary (slice), their
    row maxima, and each row's target logit where its target lies in the
    slice (else 0)."""
    z = _chunk_logits(h, w, softcap, temperature)
    target, valid = _local_targets(labels, ignore_index, vocab_start, w.shape[0])
    picked = torch.where(valid, z.gather(1, target.unsqueeze(1)).squeeze(1), 0.0)
    return z, z.max(dim=1).values, picked


def _exp_sum(z: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """Row sums of ``exp(z - peak)``, in place in ``z``: one chunk held."""
    return z.sub_(peak.unsqueeze(1)).exp_().sum(dim=1)


def _exp_moments(z: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """``[2, rows]``: row sums of ``e = exp(z - peak)`` and of ``e * (z - peak)``,
    ``z`` shifted in place and one more ``chunk x vocab`` buffer. Both add
    over vocabulary slices (``peak`` the whole row's); the entropy is then
    ``log S - T / S`` (:func:`_entropy`)."""
    shifted = z.sub_(peak.unsqueeze(1))
    e = shifted.exp()
    total = e.sum(dim=1)
    return torch.stack((total, e.mul_(shifted).sum(dim=1)))


def _entropy(moments: torch.Tensor) -> torch.Tensor:
    """Each row's entropy ``lse - sum softmax * z = log S - T / S`` from
    :func:`_exp_moments`' (whole-vocabulary) sums."""
    return moments[0].log() - moments[1] / moments[0]


def _chunk_stats(h, w, labels, ignore_index: int, vocab_start: int, softcap, temperature):
    """One chunk's log-sum-exp and target logits over the whole vocabulary
    (the weight unsplit): :func:`_logits_peak` and :func:`_exp_sum` in one."""
    z, peak, picked = _logits_peak(h, w, labels, ignore_index, vocab_start, softcap, temperature)
    return peak + _exp_sum(z, peak).log(), picked


def _chunk_grads(h, w, labels, lse, grad_rows, options: tuple, want_hidden: bool):
    """One chunk's gradient of ``sum(grad_rows * token losses)`` with respect
    to its logits (in ``h``'s dtype) and, when ``want_hidden``, to ``h``;
    ``options``: ``(ignore_index, vocab_start, softcap, temperature)``."""
    grad_z = _chunk_grad(h, w, labels, lse, grad_rows, *options).to(h.dtype)
    return grad_z, (grad_z @ w if want_hidden else None)


class _Kernels(NamedTuple):
    """The per-chunk math, eager or compiled: ``stats`` for a whole
    vocabulary, ``logits_peak`` and ``exp_sum`` (``exp_moments`` with the
    entropy) on either side of a tp all-reduce of the maxima, ``grads`` for
    backward."""

    stats: Callable
    logits_peak: Callable
    exp_sum: Callable
    exp_moments: Callable
    grads: Callable


_EAGER = _Kernels(_chunk_stats, _logits_peak, _exp_sum, _exp_moments, _chunk_grads)
_COMPILED: list[_Kernels] = []


def _kernels(compiled: bool) -> _Kernels:
    """The eager kernels, or their ``torch.compile``-d twins (made once per
    process: dynamo keeps one graph per shape class and guard set)."""
    if not compiled:
        return _EAGER
    if not _COMPILED:
        _COMPILED.append(_Kernels(*(torch.compile(fn, dynamic=None) for fn in _EAGER)))
    return _COMPILED[0]


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_forward(kernels: _Kernels, h, w, labels, options: tuple, group, entropy: bool):
    """One chunk's log-sum-exp, target logits and (``entropy``; else None)
    entropies over the whole vocabulary; under tp one all-reduce of the
    maxima and one of the exp-sums (and ``T``) and target logits, between the
    kernels. ``options``: ``(ignore_index, vocab_start, softcap, temperature)``."""
    if group is None and not entropy:
        return (*kernels.stats(h, w, labels, *options), None)
    z, peak, picked = kernels.logits_peak(h, w, labels, *options)
    peak = _all_reduce(peak, dist.ReduceOp.MAX, group)
    sums = kernels.exp_moments(z, peak) if entropy else kernels.exp_sum(z, peak).unsqueeze(0)
    sums = _all_reduce(torch.cat((sums, picked.unsqueeze(0))), dist.ReduceOp.SUM, group)
    return peak + sums[0].log(), sums[-1], _entropy(sums[:2]) if entropy else None


class _ChunkedTokenLosses(torch.autograd.Function):
    """Per-token ``lse - target logit`` over chunks (0 where ignored) and,
    with ``entropy``, per-token entropies (else an empty tensor; never
    differentiable); saves only the log-sum-exps. Backward takes a per-token
    gradient of the losses."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, options, chunk, group, kernels, entropy):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropies = torch.empty(n if entropy else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            rows, h = labels[start:end], hidden[start:end]
            valid = rows != options[0]
            stats = _chunk_forward(kernels, h, weight, rows, options, group, entropy)
            lse[start:end], picked, chunk_entropy = stats
            losses[start:end] = torch.where(valid, lse[start:end] - picked, 0.0)
            if entropy:
                entropies[start:end] = torch.where(valid, chunk_entropy, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.mark_non_differentiable(entropies)
        ctx.options = options
        ctx.chunk, ctx.group, ctx.kernels = chunk, group, kernels
        return losses, entropies

    @staticmethod
    def backward(ctx, grad_losses, _grad_entropies):
        hidden, weight, labels, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = None
        if want_weight:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h, rows = hidden[start:end], slice(start, end)
            grad_z, grad_h = ctx.kernels.grads(
                h, weight, labels[rows], lse[rows], grad_losses[rows], ctx.options, want_hidden
            )
            if want_hidden:
                grad_hidden[start:end] = grad_h
            if want_weight:
                _accumulate_weight_grad(grad_weight, grad_z, h)
            del grad_z
        if want_hidden:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, ctx.group)
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_z, h) -> None:
    """``grad_weight += grad_z.T @ h`` summed in fp32 straight into the fp32
    ``grad_weight``: a bf16 product would round a whole ``[vocab, dim]``
    partial sum per chunk before the add (thousands of weights off by an ulp
    or two against ``F.cross_entropy`` on the full logits, which rounds once).
    CUDA multiplies the bf16 operands with an fp32 output (``out_dtype``,
    torch >= 2.8); elsewhere the chunk's operands are widened to fp32 (a
    ``chunk x vocab`` copy, the size of the logits already held)."""
    if grad_z.dtype == torch.float32:
        grad_weight.addmm_(grad_z.T, h)
    elif grad_z.is_cuda:
        torch.addmm(grad_weight, grad_z.T, h, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight.addmm_(grad_z.T.float(), h.float())


def _chunk_grad(
    h, weight, labels, lse, grad_rows, ignore_index, vocab_start, softcap, temperature
) -> torch.Tensor:
    """d(sum of ``grad_rows`` x token losses) / d(pre-cap logits) of one
    chunk, fp32: ``(softmax - one-hot) x grad_row / temperature``, times the
    soft-cap's derivative."""
    z = _chunk_logits(h, weight, softcap, temperature)
    grad = (z - lse.unsqueeze(1)).exp_()  # softmax
    target, valid = _local_targets(labels, ignore_index, vocab_start, weight.shape[0])
    # Minus one at each target in this slice (a scatter: no host sync).
    grad.scatter_add_(1, target.unsqueeze(1), -valid.to(grad.dtype).unsqueeze(1))
    row_scale = torch.where(labels != ignore_index, grad_rows.float(), 0.0)
    grad *= (row_scale if temperature == 1.0 else row_scale / temperature).unsqueeze(1)
    if softcap is not None:
        capped = z if temperature == 1.0 else z * temperature
        grad *= 1.0 - (capped / softcap).square()
    return grad


def _local_targets(labels, ignore_index, vocab_start, vocab_local):
    """Labels as columns of this rank's vocabulary slice, and which rows' target lies in it."""
    local = labels - vocab_start
    valid = (labels != ignore_index) & (local >= 0) & (local < vocab_local)
    return torch.where(valid, local, 0), valid
