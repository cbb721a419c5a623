"""The context-parallel attention kernel computes every argument transformers
5.23 passes an attention function, checked against transformers' own eager
functions and masks on one process: sliding windows (with and without packed
documents), Gemma 2's soft-cap, gpt-oss's sinks, scaling and dropout; the
per-document kernel (no ``seq x seq`` mask) equals the dense masked one it
replaced; the Ulysses kernel refuses by name what it does not compute; its
span cache follows an in-place refill of the positions buffer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ray_fsdp_backend.compat import transformers as compat
from ray_fsdp_backend.context_parallel import pack_documents
from ray_fsdp_backend.context_parallel.apply import hf_ulysses_attention
from ray_fsdp_backend.context_parallel.attention import (
    document_attention,
    document_spans,
    warn_math_once,
)
from ray_fsdp_backend.context_parallel.ulysses import UlyssesAttention
from tests.dense_attention import dense_attention, document_causal_mask

pytest.importorskip("transformers")

SEQ, HEADS, KV, DIM = 32, 4, 2, 8


def _qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, SEQ, DIM, generator=g)
    k, v = (torch.randn(2, KV, SEQ, DIM, generator=g) for _ in range(2))
    return q, k, v


def _packed_positions() -> torch.Tensor:
    docs = [torch.arange(n) for n in (5, 13, 9, 20, 17)]
    return pack_documents(docs, SEQ, rows=2)["position_ids"]


def _module(**attrs) -> nn.Module:
    module = nn.Module()
    module.num_key_value_groups = HEADS // KV
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def test_spans_group_rows_by_their_documents():
    positions = _packed_positions()  # row 0: 5, 13, 9, 5 tokens; row 1: 15, 17
    assert document_spans(positions, 2) == [
        ([0], [(0, 5), (5, 18), (18, 27), (27, 32)]),
        ([1], [(0, 15), (15, 32)]),
    ]
    one_row = positions[:1]  # [1, seq] positions broadcast over 3 rows
    assert document_spans(one_row, 3) == [([0, 1, 2], document_spans(one_row, 1)[0][1])]
    assert document_spans(torch.arange(SEQ).expand(2, SEQ), 2) is None


CASES = [
    dict(window=None),
    dict(window=8),
    dict(window=5, scale=0.3),  # windows that do not divide the documents
    dict(window=8, softcap=2.0),
    dict(sinks=torch.randn(HEADS, generator=torch.Generator().manual_seed(2))),
]


@pytest.mark.parametrize("packed", [False, True, "one_row"])
@pytest.mark.parametrize("options", CASES, ids=["causal", "window", "window5", "softcap", "sinks"])
def test_per_document_kernel_equals_the_dense_mask(packed, options):
    """Outputs and gradients of the per-document kernel against SDPA (or the
    explicit form) under the dense [b, 1, S, S] mask, grouped-query heads."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    positions = _packed_positions() if packed else torch.arange(SEQ).expand(2, SEQ)
    if packed == "one_row":
        positions = positions[:1]
    window = options.get("window")
    mask = document_causal_mask(positions.expand(2, SEQ), window)
    theirs = dense_attention(q, k, v, mask, **{k: v for k, v in options.items() if k != "window"})
    ours = document_attention(q, k, v, document_spans(positions, 2), **options)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(theirs.square().sum(), (q, k, v))
    for mine, ref in zip(torch.autograd.grad(ours.square().sum(), (q, k, v)), grads, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


def test_math_kernel_warning_is_for_half_precision_cuda_runs_only():
    q = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    assert not warn_math_once(q, "softcap")  # CPU: flash or math is the run's own choice


def _additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))


@pytest.mark.parametrize("packed", [False, True])
def test_window_and_document_mask_equal_transformers(packed):
    from transformers import MistralConfig

    from ray_fsdp_backend.compat.transformers import create_sliding_window_causal_mask

    config = MistralConfig(sliding_window=8, hidden_size=32, num_attention_heads=4)
    config._attn_implementation = "sdpa"
    positions = _packed_positions() if packed else torch.arange(SEQ).expand(2, SEQ)
    theirs = create_sliding_window_causal_mask(
        config=config,
        inputs_embeds=torch.empty(2, SEQ, 32),
        attention_mask=None,
        cache=None,
        position_ids=positions,
    )
    assert torch.equal(document_causal_mask(positions, window=8), theirs.expand(2, 1, SEQ, SEQ))


def test_softcap_window_and_scaling_equal_gemma2_eager():
    eager_attention_forward = compat.eager_attention_forward("gemma2")

    q, k, v = _qkv()
    mask = document_causal_mask(_packed_positions(), window=8)
    module = _module(training=False)
    theirs, _ = eager_attention_forward(
        module, q, k, v, _additive(mask), dropout=0.0, scaling=0.3, softcap=2.0
    )
    spans = document_spans(_packed_positions(), 2)
    ours = document_attention(q, k, v, spans, scale=0.3, window=8, softcap=2.0)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=1e-6, atol=1e-6)
    plain = document_attention(q, k, v, spans, scale=0.3, window=8)
    assert (plain - ours).abs().max() > 1e-2  # the cap changes the numbers


def test_sinks_equal_gpt_oss_eager():
    eager_attention_forward = compat.eager_attention_forward("gpt_oss")

    q, k, v = _qkv()
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(1))
    mask = document_causal_mask(_packed_positions())
    module = _module(training=False, sinks=sinks)
    theirs, _ = eager_attention_forward(module, q, k, v, _additive(mask), scaling=0.35)
    ours = document_attention(
        q, k, v, document_spans(_packed_positions(), 2), scale=0.35, sinks=sinks
    )
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=1e-5, atol=1e-6)


def test_dropout_draws_as_transformers_eager_does():
    eager_attention_forward = compat.eager_attention_forward("gemma2")

    q, k, v = _qkv()
    mask = document_causal_mask(torch.arange(SEQ).expand(2, SEQ), window=8)
    module = _module(training=True)
    torch.manual_seed(3)
    theirs, _ = eager_attention_forward(
        module, q, k, v, _additive(mask), dropout=0.5, scaling=0.3, softcap=2.0
    )
    torch.manual_seed(3)
    options = dict(scale=0.3, window=8, softcap=2.0)
    ours = document_attention(q, k, v, None, dropout=0.5, **options)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=1e-6, atol=1e-6)
    assert (ours - document_attention(q, k, v, None, **options)).abs().max() > 1e-2


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_span_cache_follows_a_buffer_refilled_in_place(one_rank):
    ulysses = UlyssesAttention(one_rank)
    buffer = torch.arange(SEQ).expand(2, SEQ).contiguous()
    assert ulysses.document_spans(buffer, 2) is None  # one document per row
    buffer.copy_(_packed_positions())  # the next batch, same tensor
    spans = ulysses.document_spans(buffer, 2)
    assert spans == document_spans(buffer, 2) and spans is not None
    assert ulysses.document_spans(buffer, 2) is spans  # found once per batch


def test_ulysses_refuses_by_name_what_it_does_not_compute(one_rank):
    ulysses = UlyssesAttention(one_rank)
    q, k, v = _qkv()
    module = _module()
    with pytest.raises(ValueError, match="position_bias"):
        hf_ulysses_attention(module, q, k, v, None, ulysses=ulysses, position_bias=q)
    with pytest.raises(ValueError, match="attention_mask"):
        hf_ulysses_attention(module, q, k, v, torch.ones(2, SEQ), ulysses=ulysses)
    with pytest.raises(ValueError, match="is_causal"):
        hf_ulysses_attention(module, q, k, v, None, ulysses=ulysses, is_causal=False)
    out, _ = hf_ulysses_attention(
        module, q, k, v, None, ulysses=ulysses, output_router_logits=False, softcap=2.0
    )
    assert out.shape == (2, SEQ, HEADS, DIM)


def test_ring_refuses_transformers_models_by_name_before_anything_moves():
    from transformers import MistralForCausalLM

    from ray_fsdp_backend.context_parallel.apply import check_context_parallel
    from tests.zoo_families import family_config

    with torch.device("meta"):
        model = MistralForCausalLM(family_config("mistral"))
    with pytest.raises(ValueError, match="ring.*MistralForCausalLM.*sliding_window, softcap"):
        check_context_parallel(model, "ring")
    assert check_context_parallel(model, "ulysses").value == "ulysses"


def _saved_storages(fn, *inputs) -> list[torch.Tensor]:
    """One tensor per distinct storage autograd saves for ``fn``'s backward."""
    seen: dict[int, torch.Tensor] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs).sum().backward()
    return list(seen.values())


def test_window_chunks_and_documents_share_one_saved_bias_per_shape():
    """8 chunks of 64 in each of 2 packed documents: SDPA saves a mask's
    float form per call; the biases are built once per shape (the first
    chunk's, the inner chunks'), so 2 are saved, not 16."""
    seq, window = 1024, 64
    q, k, v = (torch.randn(1, 2, seq, 8, requires_grad=True) for _ in range(3))
    spans = [([0], [(0, seq // 2), (seq // 2, seq)])]
    saved = _saved_storages(lambda *t: document_attention(*t, spans, window=window), q, k, v)
    biases = [t for t in saved if t.ndim == 2 and t.is_floating_point()]
    assert sorted(tuple(b.shape) for b in biases) == [(64, 64), (64, 127)]
