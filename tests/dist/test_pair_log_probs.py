"""``pair_log_probs`` / ``ctx.sequence_log_probs`` on gloo ranks against one
process running each sequence alone through the whole fp32 logits.

Packed preference rows (several pairs a row, prompts and padding -100, a
padding tail with ``sequence_ids`` -1) of the example decoder, on dp 2
(FSDP), tp 2 (the head's vocabulary split over tp, ``loss_parallel``) and
dp_shard 2 x cp 2 (cp cuts every row, documents across the cut), and a
transformers Qwen3-MoE at ep 2 (its experts split over two ranks): the
per-token log-probs of this rank's tokens and their entropies
(``entropy=True``: fused, and from the whole logits with ``chunk_tokens=0``;
against ``-(softmax * log_softmax).sum(-1)``), each pair's summed log-probs and
token counts, and the model's gradients of a DPO loss over the step's pairs
equal one process's within 1e-5 (the gradient: a DPO sigmoid loss on fixed
reference log-probs, summed over each rank's pairs over the global pair
count; FSDP averages over dp x cp).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist.harness import run_ranks

SEQ = 24
ROWS = (  # (prompt, chosen, rejected) lengths of each row's pairs
    ((3, 2, 3), (2, 4, 2)),
    ((4, 3, 2), (1, 2, 2)),
    ((2, 3, 3), (2, 2, 2), (1, 1, 2)),
    ((5, 6, 5),),
)
LAYOUTS = {
    "dp2": (2, dict()),
    "tp2 loss_parallel": (2, dict(tensor_parallel_size=2, loss_parallel=True)),
    "dp_shard2 x cp2": (4, dict(context_parallel_size=2)),
    # A transformers Qwen3-MoE (4 experts, top-2), its experts split over ep 2.
    "ep2 qwen3_moe": (2, dict(expert_parallel_size=2)),
}
VOCAB = 64


def _documents():
    """Per pair (row-major): the chosen and rejected documents as (tokens, labels)."""
    gen = torch.Generator().manual_seed(3)
    pairs = []
    for row in ROWS:
        for prompt, chosen, rejected in row:
            head = torch.randint(0, VOCAB, (prompt,), generator=gen)
            docs = []
            for n in (chosen, rejected):
                tokens = torch.cat([head, torch.randint(0, VOCAB, (n,), generator=gen)])
                docs.append((tokens, torch.cat([torch.full((prompt,), -100), tokens[prompt:]])))
            pairs.append(docs)
    return pairs


def _packed_batch():
    """The rows as the trainer's micro-batch (targets shifted, unsplit)."""
    from ray_fsdp_backend.context_parallel.sequence import shift_labels

    pairs, out, k = _documents(), {k: [] for k in ("ids", "labels", "pos", "seq")}, 0
    for row in ROWS:
        parts = {k: [] for k in out}
        for p in range(len(row)):
            for s, (tokens, labels) in enumerate(pairs[k + p]):
                parts["ids"].append(tokens)
                parts["labels"].append(labels)
                parts["pos"].append(torch.arange(len(tokens)))
                parts["seq"].append(torch.full((len(tokens),), 2 * p + s))
        k += len(row)
        pad = SEQ - sum(len(t) for t in parts["ids"])
        for key, fill in (("ids", torch.zeros(pad, dtype=torch.long)), ("labels", None)):
            parts[key].append(fill if fill is not None else torch.full((pad,), -100))
        parts["pos"].append(torch.arange(pad))
        parts["seq"].append(torch.full((pad,), -1))
        for key in out:
            out[key].append(torch.cat(parts[key]))
    position_ids = torch.stack(out["pos"])
    return {
        "input_ids": torch.stack(out["ids"]),
        "targets": shift_labels(torch.stack(out["labels"]), position_ids),
        "position_ids": position_ids,
        "sequence_ids": torch.stack(out["seq"]),
    }


def _ref_log_probs(pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed reference log-prob sums for the DPO loss."""
    k = torch.arange(pairs, dtype=torch.float32)
    return -6.0 - 0.3 * k, -5.0 - 0.2 * k


def _logits(model, tokens, **kw) -> torch.Tensor:
    output = model(tokens, **kw)
    return getattr(output, "logits", output)  # a transformers model's output


def _reference(model):
    """One process, ``model`` unwrapped: every sequence alone, whole fp32
    logits; per-pair sums, counts, the DPO loss's gradients; and the packed
    rows' per-token log-probs."""
    import ray_fsdp_backend as rfb
    from ray_fsdp_backend.context_parallel.sequence import shift_labels
    from ray_fsdp_backend.ops.loss import logits_token_log_probs

    sums, counts = [], []
    for docs in _documents():
        for tokens, labels in docs:
            targets = shift_labels(labels[None])
            logits = _logits(model, tokens[None]).float()
            log_probs = F.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[..., None])
            sums.append(log_probs[..., 0][targets != -100].sum())
            counts.append((targets != -100).sum().float())
    sums, counts = torch.stack(sums), torch.stack(counts)
    chosen, rejected = sums[0::2], sums[1::2]
    loss = rfb.dpo_loss(chosen, rejected, *_ref_log_probs(len(chosen))).losses.mean()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    batch = _packed_batch()
    with torch.no_grad():
        logits = _logits(model, batch["input_ids"], position_ids=batch["position_ids"])
        tokens = logits_token_log_probs(logits, batch["targets"])
        log_probs = F.log_softmax(logits.float(), -1)
        entropies = -(torch.softmax(logits.float(), -1) * log_probs).sum(-1)
        entropies = torch.where(batch["targets"] == -100, 0.0, entropies)
    pairs = (chosen.detach(), rejected.detach(), counts[0::2], counts[1::2])
    return pairs, grads, (tokens, entropies)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _models(ctx, moe: bool):
    """The wrapped model and an unwrapped one with the same weights."""
    from ray_fsdp_backend.models.decoder import ModelConfig, Transformer

    torch.manual_seed(0)
    if moe:
        import transformers

        from ray_fsdp_backend.models.tiny_pretrained import tiny_config

        config = tiny_config("qwen3_moe")
        config.num_experts, config.use_cache = 4, False
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        reference = copy.deepcopy(model)
        return ctx.wrap(model), reference
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, seq_len=SEQ)
    with torch.device("meta"):
        model = ctx.wrap(Transformer(cfg))
    reference = Transformer(cfg)
    reference.load_state_dict({k: _full(v).detach().clone() for k, v in model.state_dict().items()})
    return model, reference


def _layout(settings: dict) -> dict:
    import ray_fsdp_backend as rfb
    from ray_fsdp_backend.context_parallel.sequence import chunk_indices
    from ray_fsdp_backend.runtime.worker import setup_process_context
    from ray_fsdp_backend.settings.config import FSDPSettings

    ctx = setup_process_context(
        FSDPSettings(use_fsdp=True, use_mixed_precision=False, **settings), torch.device("cpu")
    )
    model, reference = _models(ctx, moe=ctx.ep_size > 1)
    if ctx.ep_size > 1:  # the experts are split over the ep axis
        experts = [p for n, p in model.named_parameters() if "experts" in n]
        assert experts and all("ep" in p.device_mesh.mesh_dim_names for p in experts)
    want_pairs, want_grads, (want_tokens, want_entropies) = _reference(reference)

    per = len(ROWS) // ctx.dp_size
    rows = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
    first = sum(len(r) for r in ROWS[: rows.start])  # this rank's first pair
    mine = slice(first, first + sum(len(r) for r in ROWS[rows]))
    batch = ctx.shard_sequence({k: v[rows] for k, v in _packed_batch().items()})
    with ctx.loss_parallel():
        tokens = ctx.sequence_log_probs(model, batch, chunk_tokens=5)
        with torch.no_grad():  # the whole-logits path (a head the kernel cannot take)
            whole = ctx.sequence_log_probs(model, batch, chunk_tokens=0, entropy=True)
            fused = ctx.sequence_log_probs(model, batch, chunk_tokens=5, entropy=True)
        got = rfb.pair_log_probs(ctx, model, batch, chunk_tokens=5)
        ref_c, ref_r = (t[mine] for t in _ref_log_probs(len(want_pairs[0])))
        losses = rfb.dpo_loss(got.chosen, got.rejected, ref_c, ref_r).losses
        (losses.sum() * ctx.dp_size / len(want_pairs[0])).backward()
    index = chunk_indices(SEQ, ctx.cp_rank, ctx.cp_size, load_balance=False)
    errors = {
        "tokens": (tokens.detach() - want_tokens[rows][:, index]).abs().max(),
        "tokens, whole logits": (whole[0] - want_tokens[rows][:, index]).abs().max(),
        "tokens, with entropy": (fused[0] - want_tokens[rows][:, index]).abs().max(),
        "entropy": (fused[1] - want_entropies[rows][:, index]).abs().max(),
        "entropy, whole logits": (whole[1] - want_entropies[rows][:, index]).abs().max(),
        **{
            name: (g.detach() - w[mine]).abs().max()
            for name, g, w in zip(got._fields, got, want_pairs, strict=True)
        },
        "grads": max(
            (_full(p.grad) - want_grads[n]).abs().max() for n, p in model.named_parameters()
        ),
    }
    errors = torch.stack(list(errors.values())), list(errors)
    dist.all_reduce(errors[0], op=dist.ReduceOp.MAX)
    return dict(zip(errors[1], errors[0].tolist(), strict=True))


def _run(rank, world, settings):
    torch.set_num_threads(1)
    return _layout(settings)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pair_log_probs_equal_one_process_full_logits(layout):
    world, settings = LAYOUTS[layout]
    errors = run_ranks(_run, world, settings)
    assert max(errors.values()) < 1e-5, errors
