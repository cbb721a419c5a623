"""``rfb.linear_token_log_probs`` against ``log_softmax(logits / T).gather``
on the full fp32 logits, and the per-sequence sums of packed rows.

Value and both gradients (hidden and weight, under a random per-token
upstream gradient) within 1e-5 in fp32 with -100 targets, Gemma 2's
soft-cap, a temperature and a chunk that does not divide the tokens; bf16
inputs within a stated tolerance; ``compile=True`` once. The entropy output
(``entropy=True``) against ``-(softmax * log_softmax).sum(-1)`` of the same
logits, and its two chunk sums added over vocabulary slices (a tp head's
all-reduce) against the whole row's. ``linear_cross_entropy``
is minus the same kernel's sum (its own tests: test_linear_cross_entropy.py).
``sequence_sums`` / ``sum_pairs`` against per-sequence loops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ray_fsdp_backend as rfb
from ray_fsdp_backend.ops.sequences import sequence_sums, sequences_per_row
from ray_fsdp_backend.preference.log_probs import sum_pairs

ROWS, SEQ, DIM, VOCAB = 3, 15, 16, 96


def _operands(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, SEQ, DIM, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, DIM, generator=gen) * 0.5).to(dtype)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    targets[0, :4] = -100
    targets[2, 7] = -100
    upstream = torch.randn(ROWS, SEQ, generator=gen)
    return hidden, weight, targets, upstream


def _reference(hidden, weight, targets, softcap=None, temperature=1.0):
    """The published formula on the whole fp32 logits."""
    logits = hidden.float() @ weight.float().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = F.log_softmax(logits / temperature, dim=-1)
    picked = log_probs.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets == -100, 0.0, picked)


def _value_and_grads(fn, hidden, weight, targets, upstream, **kw):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    values = fn(hidden, weight, targets, **kw)
    (values * upstream).sum().backward()
    return values.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [7, 1000])
def test_fp32_equals_full_logits_log_softmax(softcap, temperature, chunk):
    hidden, weight, targets, upstream = _operands()
    kw = dict(softcap=softcap, temperature=temperature)
    got = _value_and_grads(
        rfb.linear_token_log_probs, hidden, weight, targets, upstream, chunk_size=chunk, **kw
    )
    want = _value_and_grads(_reference, hidden, weight, targets, upstream, **kw)
    assert got[0].dtype == torch.float32 and got[0].shape == targets.shape
    assert torch.count_nonzero(got[0][targets == -100]) == 0
    for name, g, w in zip(("log-probs", "hidden grad", "weight grad"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_compiled_equals_full_logits():
    hidden, weight, targets, upstream = _operands(seed=1)
    kw = dict(softcap=2.5, temperature=0.7)
    got = _value_and_grads(
        rfb.linear_token_log_probs,
        hidden,
        weight,
        targets,
        upstream,
        chunk_size=7,
        compile=True,
        **kw,
    )
    want = _value_and_grads(_reference, hidden, weight, targets, upstream, **kw)
    for name, g, w in zip(("log-probs", "hidden grad", "weight grad"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"compiled {name}")


def test_bf16_inputs_match_the_fp32_reference():
    """bf16 hidden and weight (fp32 softmax): log-probs within 2e-2 of the
    fp32 reference; gradients in bf16 within 2e-2."""
    hidden, weight, targets, upstream = _operands(torch.bfloat16)
    got = _value_and_grads(
        rfb.linear_token_log_probs, hidden, weight, targets, upstream, chunk_size=8, softcap=2.5
    )
    want = _value_and_grads(
        _reference, hidden.float(), weight.float(), targets, upstream, softcap=2.5
    )
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    for name, g, w in zip(("log-probs", "hidden grad", "weight grad"), got, want, strict=True):
        torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=2e-2, msg=name)


def test_cross_entropy_is_minus_the_log_probs_sum():
    hidden, weight, targets, _ = _operands()
    loss = rfb.linear_cross_entropy(hidden, weight, targets, chunk_size=7)
    log_probs = rfb.linear_token_log_probs(hidden, weight, targets, chunk_size=5)
    torch.testing.assert_close(loss, -log_probs.sum(), rtol=1e-6, atol=1e-5)


def _reference_entropy(hidden, weight, targets, softcap=None, temperature=1.0):
    """``-(softmax * log_softmax).sum(-1)`` of the whole fp32 logits, 0 where ignored."""
    logits = hidden.float() @ weight.float().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = F.log_softmax(logits / temperature, dim=-1)
    return torch.where(targets == -100, 0.0, -(log_probs.softmax(-1) * log_probs).sum(-1))


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [7, 1000])
def test_entropy_equals_full_logits_entropy(softcap, temperature, chunk):
    """The entropy output of the same chunked pass: each token's, 0 where
    ignored; the log-probs and their gradients are what they are without it."""
    hidden, weight, targets, upstream = _operands(seed=2)
    kw = dict(softcap=softcap, temperature=temperature)
    hidden = hidden.detach().requires_grad_()
    log_probs, entropies = rfb.linear_token_log_probs(
        hidden, weight, targets, chunk_size=chunk, entropy=True, **kw
    )
    assert not entropies.requires_grad and entropies.shape == targets.shape
    want = _reference_entropy(hidden.detach(), weight, targets, **kw)
    assert torch.count_nonzero(entropies[targets == -100]) == 0
    assert want[targets != -100].min() > 0.1  # not a vanishing quantity
    torch.testing.assert_close(entropies, want, rtol=1e-5, atol=1e-5)
    (log_probs * upstream).sum().backward()
    alone = _value_and_grads(
        rfb.linear_token_log_probs, hidden, weight, targets, upstream, chunk_size=chunk, **kw
    )
    assert torch.equal(log_probs.detach(), alone[0]) and torch.equal(hidden.grad, alone[1])
    whole = rfb.ops.loss.logits_token_log_probs(
        _logits(hidden.detach(), weight, softcap), targets, temperature=temperature, entropy=True
    )
    torch.testing.assert_close(whole[1], want, rtol=1e-5, atol=1e-5)


def _logits(hidden, weight, softcap):
    logits = hidden @ weight.T
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def test_entropy_sums_add_over_vocabulary_slices():
    """The chunk's two sums, taken per vocabulary slice against the whole
    row's maximum and added (what a tp all-reduce does), give the entropy of
    the whole row: the accumulation the vocabulary-parallel head relies on."""
    from ray_fsdp_backend.ops.loss import _entropy, _exp_moments

    hidden, weight, targets, _ = _operands(seed=3)
    logits = (hidden.reshape(-1, DIM) @ weight.T) * 3.0  # peaked rows: exp(d) far from 1
    peak = logits.max(dim=1).values
    slices = [logits[:, :40].clone(), logits[:, 40:].clone()]  # one holds no row's maximum
    added = sum(_exp_moments(z, peak) for z in slices)
    want = _reference_entropy(hidden.reshape(-1, DIM) * 3.0, weight, targets.reshape(-1))
    valid = targets.reshape(-1) != -100
    torch.testing.assert_close(_entropy(added)[valid], want[valid], rtol=1e-5, atol=1e-5)
    whole = _exp_moments(logits.clone(), peak)
    torch.testing.assert_close(added, whole, rtol=1e-5, atol=1e-5)


def test_compiled_entropy_equals_full_logits():
    hidden, weight, targets, _ = _operands(seed=4)
    _, entropies = rfb.linear_token_log_probs(
        hidden, weight, targets, chunk_size=7, softcap=2.5, temperature=0.7, compile=True,
        entropy=True,
    )  # fmt: skip
    want = _reference_entropy(hidden, weight, targets, softcap=2.5, temperature=0.7)
    torch.testing.assert_close(entropies, want, rtol=1e-5, atol=1e-5)


def test_refusals_name_the_argument():
    hidden, weight, targets, _ = _operands()
    for bad in (0.0, -1.0, True):
        with pytest.raises(ValueError, match=rf"temperature={bad!r} must be a number above 0"):
            rfb.linear_token_log_probs(hidden, weight, targets, temperature=bad)
    with pytest.raises(ValueError, match="chunk_size=0"):
        rfb.linear_token_log_probs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="already shifted"):
        rfb.linear_token_log_probs(hidden, weight, targets[:, 1:])


# Two rows of packed pairs: row 0 holds pairs 0 and 1, then padding; row 1
# holds one pair. -100 targets inside sequences count for nothing.
IDS = torch.tensor(
    [
        [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, -1, -1],
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
    ]
)


def _loop_sums(values, ids, targets):
    """Per pair, by Python loops: (chosen, rejected, chosen count, rejected count)."""
    out = []
    for row in range(ids.shape[0]):
        for pair in range(int(ids[row].max()) // 2 + 1):
            parts = []
            for seq in (2 * pair, 2 * pair + 1):
                keep = (ids[row] == seq) & (targets[row] != -100)
                parts.append((values[row][keep].sum(), keep.sum().float()))
            out.append((parts[0][0], parts[1][0], parts[0][1], parts[1][1]))
    return [torch.stack(column) for column in zip(*out, strict=True)]


def test_sum_pairs_equals_per_sequence_loops():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(IDS.shape, generator=gen, requires_grad=True)
    targets = torch.randint(0, 9, IDS.shape, generator=gen)
    targets[0, 0], targets[0, 5], targets[1, :3] = -100, -100, -100
    targets[IDS < 0] = -100
    got = sum_pairs(values, targets, IDS)
    want = _loop_sums(values, IDS, targets)
    for name, g, w in zip(got._fields, got, want, strict=True):
        torch.testing.assert_close(g, w, msg=name)
    upstream = torch.randn(3, generator=gen)
    (grad_got,) = torch.autograd.grad((got.chosen * upstream).sum(), values)
    (grad_want,) = torch.autograd.grad((want[0] * upstream).sum(), values)
    torch.testing.assert_close(grad_got, grad_want)


def test_sequence_sums_sizes_from_the_ids_and_skips_minus_one():
    values = torch.ones(IDS.shape)
    sums, counts = sequence_sums(values, IDS)
    assert sums.shape == (2, 4)
    assert counts.tolist() == [[3, 2, 4, 2], [6, 7, 0, 0]]
    assert sequences_per_row(IDS).tolist() == [4, 2]


def test_an_odd_row_is_refused_by_row():
    ids = IDS.clone()
    ids[1, 6:] = 2  # row 1: sequences 0 and 2 only (max 2: three sequences)
    with pytest.raises(ValueError, match=r"rows \[1\] hold an odd number of sequences \[3\]"):
        sum_pairs(torch.zeros(ids.shape), torch.zeros_like(ids), ids)


def test_the_dpo_loss_path_never_holds_the_whole_logits():
    """Qwen3's vocabulary (151,936), 4 rows x 64 tokens of packed pairs
    through the example decoder, ``linear_token_log_probs``, ``sum_pairs``
    and ``dpo_loss``, forward and backward: the profiler's allocation records
    hold no tensor of a quarter of the ``tokens x vocab`` fp32 logits (155
    MB; a chunk's logits are 16 x vocab), while the full-logits path's do,
    and the peak rises by under a quarter of the full path's."""
    from benchmarks.fused_loss import host_allocations, peak_rise
    from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
    from ray_fsdp_backend.ops.head import head_hidden_states, resolve_loss_head

    vocab, rows, seq = 151_936, 4, 64
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=vocab, dim=16, n_layers=1, n_heads=2, seq_len=seq))
    inputs = torch.randint(0, vocab, (rows, seq))
    targets = torch.randint(0, vocab, (rows, seq))
    ids = torch.arange(seq).div(seq // 4, rounding_mode="floor").expand(rows, seq)  # 2 pairs a row
    targets[:, :: seq // 4] = -100  # each sequence's first token: a prompt
    reference = torch.zeros(rows * 2)
    whole = rows * seq * vocab * 4

    def loss(log_probs):
        pairs = sum_pairs(log_probs, targets, ids)
        rfb.dpo_loss(pairs.chosen, pairs.rejected, reference, reference).losses.sum().backward()

    def fused():
        head = resolve_loss_head(model)
        hidden, _ = head_hidden_states(model, head, inputs)
        loss(rfb.linear_token_log_probs(hidden, head.module.weight, targets, chunk_size=16))

    def full():
        logits = model(inputs)
        picked = F.log_softmax(logits.float(), -1).gather(-1, targets.clamp_min(0)[..., None])
        loss(torch.where(targets == -100, 0.0, picked[..., 0]))

    full_sizes, fused_sizes = host_allocations(full), host_allocations(fused)
    assert max(full_sizes) >= whole  # the watch sees the logits where they exist
    assert max(fused_sizes) < whole // 4, (max(fused_sizes), whole)
    # Measured: 32 MB against 623 MB (the largest allocations 9.7 / 156 MB).
    assert peak_rise(fused_sizes) < peak_rise(full_sizes) / 4
