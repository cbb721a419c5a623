"""Tensor parallelism on 4 gloo ranks against one process on the same data.

One spawn runs every case: the example decoder and a tiny Llama, tp 2 x
dp_shard 2 (full_shard) and HSDP 2 x (1 x 2), sequence parallel on and off,
loss parallel, ``no_sync`` accumulation. Each case loads the same weights
(``load_pretrained``: every rank reads its TP x FSDP slice), compares the
logits, then trains a few AdamW steps (``foreach``) on per-dp-rank batches
with the global clip: losses and pre-clip norms step by step equal the
single-process run on the global batch (fp32). Then the norm of one more
backward's gradients for ``norm_type`` 2, 1 and inf equals torch's on the
unsharded model, with one all-reduce per (mesh, sharded axes) bucket.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
from ray_fsdp_backend.distributed.mesh import build_device_mesh, resolve_layout
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.planning.topology import topology_from_node_counts
from ray_fsdp_backend.strategies.blocks import materialize_meta_module
from tests.dist.harness import run_ranks
from tests.hf_models import VOCAB, save_tiny_pretrained

pytest.importorskip("transformers")

WORLD, STEPS, LR, MAX_NORM = 4, 3, 3e-3, 0.05
BATCH, SEQ = 4, 16
DECODER = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=SEQ)

# name: (model, strategy, hsdp replicate size, sequence_parallel, loss_parallel, micro-batches)
CASES = {
    "decoder_sp": ("decoder", "full_shard", None, True, False, 1),
    # with activation checkpointing (the flag below): TP, then checkpointing, then fully_shard
    "decoder_hsdp_loss_parallel_no_sync": ("decoder", "hybrid_shard", 2, False, True, 2),
    "llama": ("llama", "full_shard", None, None, False, 1),
    "llama_hsdp_loss_parallel": ("llama", "hybrid_shard", 2, None, True, 1),
}
NORM_TYPES = (2.0, 1.0, math.inf)


def _batches(vocab: int):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (STEPS + 1, BATCH, SEQ + 1), generator=g)
    return tokens[..., :-1], tokens[..., 1:]


def _loss(model, kind, x, y) -> torch.Tensor:
    if kind == "decoder":
        return model.loss(x, y)
    logits = model(x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _logits(model, kind, x) -> torch.Tensor:
    out = model(x) if kind == "decoder" else model(x).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def _build(kind, path):
    if kind == "decoder":
        with torch.device("meta"):
            return Transformer(DECODER)
    from ray_fsdp_backend.hf.models import build_causal_lm

    return build_causal_lm(path)


def _run_case(rank, kind, strategy_name, replicate, sp, lp, micro, path):
    cfg = FSDPConfig(
        use_fsdp=True,
        fsdp_sharding_strategy=strategy_name,
        fsdp_hsdp_replicate_size=replicate,
        tensor_parallel_size=2,
        sequence_parallel=sp,
        loss_parallel=lp,
        use_mixed_precision=False,
        use_gradient_checkpointing=micro > 1,
    )
    layout = resolve_layout(cfg, topology_from_node_counts([WORLD]))
    strategy = build_strategy(
        cfg, device=torch.device("cpu"), local_rank=rank, mesh=build_device_mesh(layout, "cpu")
    )
    torch.manual_seed(0)
    model = strategy.wrap(_build(kind, path))
    init = {}  # the decoder's random init (the Llama's comes from its checkpoint)
    if kind == "decoder":
        init = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    load_pretrained(model, path)
    xs, ys = _batches(DECODER.vocab_size if kind == "decoder" else VOCAB)
    with torch.no_grad():
        logits = _logits(model, kind, xs[0])
    dp_rank, dp_size = layout.data_parallel_coordinates(rank)
    rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    losses, norms = [], []
    for step in range(STEPS + 1):
        x, y = xs[step, rows], ys[step, rows]
        total = 0.0
        for i, (mx, my) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            sync = strategy.no_sync(model) if i < micro - 1 else _nullcontext()
            with sync, strategy.loss_parallel():
                loss = _loss(model, kind, mx, my) / micro
                loss.backward()
            total += loss.item()
        summed = torch.tensor(total)
        dist.all_reduce(summed)  # the tp ranks of a dp shard hold the same loss
        losses.append(float(summed) / WORLD)
        if step == STEPS:  # one more backward: norms of every type, no step
            measured = {}
            for p in NORM_TYPES:
                norm = strategy.clip_grad_norm(model, None, norm_type=p)
                measured[p] = (float(norm), strategy.last_grad_clip_stats["num_collectives"])
            break
        norms.append(float(strategy.clip_grad_norm(model, MAX_NORM, optimizer=opt)))
        opt.step()
        opt.zero_grad()
    placements = {
        name: tuple(repr(pl) for pl in p.placements)
        for name, p in model.named_parameters()
        if name.endswith(("wq.weight", "q_proj.weight", "norm.weight"))
    }
    return dict(
        mesh=layout.axis_names,
        init=init,
        logits=logits,
        losses=losses,
        norms=norms,
        measured=measured,
        placements=placements,
    )


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def _all_cases(rank, world, paths):
    return {name: _run_case(rank, *case, paths[case[0]]) for name, case in CASES.items()}


def _reference(kind, path, micro):
    """The same weights, data and optimizer in one process on the global batch."""
    if kind == "decoder":
        model = Transformer(DECODER)
        model.load_state_dict(_decoder_state(path), strict=False)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    xs, ys = _batches(DECODER.vocab_size if kind == "decoder" else VOCAB)
    with torch.no_grad():
        logits = _logits(model, kind, xs[0])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    losses, norms = [], []
    for step in range(STEPS + 1):
        # Per dp rank (2 of them): the mean over its rows, micro-batched; then
        # the dp mean, as FSDP averages gradients.
        total = 0.0
        for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            x, y = xs[step, half], ys[step, half]
            for mx, my in zip(x.chunk(micro), y.chunk(micro), strict=True):
                loss = _loss(model, kind, mx, my) / micro / 2
                loss.backward()
                total += loss.item()
        losses.append(total)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if step == STEPS:
            measured = {p: float(torch.nn.utils.get_total_norm(grads, p)) for p in NORM_TYPES}
            break
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return dict(logits=logits, losses=losses, norms=norms, measured=measured)


def _decoder_state(path):
    from safetensors.torch import load_file

    return load_file(path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    decoder = Transformer(DECODER)
    paths = {"decoder": str(root / "decoder.safetensors"), "llama": str(root / "llama")}
    # Tied head: the checkpoint holds the embedding once, as transformers saves it.
    state = {k: v.clone() for k, v in decoder.state_dict().items() if k != "output.weight"}
    save_file(state, paths["decoder"])
    save_tiny_pretrained("llama", paths["llama"])
    got = run_ranks(_all_cases, WORLD, paths)
    refs = {
        (kind, micro): _reference(kind, paths[kind], micro)
        for kind, _, _, _, _, micro in CASES.values()
    }
    return got, refs


@pytest.mark.parametrize("name", list(CASES))
def test_tp_matches_one_process(results, name):
    got, refs = results
    kind, strategy, replicate, _, _, micro = CASES[name]
    ref = refs[(kind, micro)]
    case = got[name]
    expected_mesh = ("dp_shard", "tp") if replicate is None else ("dp_replicate", "dp_shard", "tp")
    assert case["mesh"] == expected_mesh
    torch.testing.assert_close(case["logits"], ref["logits"], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(case["losses"], ref["losses"], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(case["norms"], ref["norms"], atol=2e-5, rtol=1e-4)
    assert ref["norms"][0] > MAX_NORM  # the clip is active
    for p in NORM_TYPES:
        norm, collectives = case["measured"][p]
        torch.testing.assert_close(norm, ref["measured"][p], atol=2e-6, rtol=1e-4)
        # Buckets: TP-split weights (sharded on dp and tp) and replicated norms
        # (sharded on dp only): one all-reduce per sharded axis of each.
        assert collectives == 3


def test_meta_init_on_cpu_equals_one_process_from_the_same_seed(results):
    """Meta-built and sharded over tp 2 x dp 2 (a _StridedShard dim), the
    decoder's random init is the one-process init: no two shards alike."""
    got, _ = results
    torch.manual_seed(0)
    with torch.device("meta"):
        ref = Transformer(DECODER)
    materialize_meta_module(ref, "cpu")
    for name in ("decoder_sp", "decoder_hsdp_loss_parallel_no_sync"):
        init = got[name]["init"]
        assert init.keys() == dict(ref.named_parameters()).keys()
        for key, value in ref.named_parameters():
            assert torch.equal(init[key], value), (name, key)


def test_placements_split_weights_on_tp_and_replicate_norms(results):
    got, _ = results
    placements = got["decoder_sp"]["placements"]
    wq = placements["layers.0.attention.wq.weight"]
    assert "Shard(dim=0)" in wq[1] and "StridedShard" in wq[0]  # FSDP over a colwise split
    assert placements["norm.weight"][1] == "Replicate()"
    llama = got["llama"]["placements"]
    assert llama["model.layers.0.input_layernorm.weight"][1] == "Replicate()"
