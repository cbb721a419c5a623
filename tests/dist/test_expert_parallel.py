"""Expert parallelism on 4 gloo ranks against one process on the same data.

One spawn runs every case: a tiny Qwen3-MoE (8 experts, top-2) at ep 2
(two ep groups; the experts FSDP-sharded over the pair holding the same
ones), at ep 4, under HSDP (2 replicas x dp_shard 2, ep 2), and with every
router forced to pick among ep rank 0's experts (the other ranks receive no
token: both exchanges and the reduce-scatter still run); a tiny Mixtral and
a Qwen2-MoE with a shared expert at ep 2; LoRA on the Qwen3-MoE's attention
(frozen experts) at ep 2, adapters loaded from a PEFT directory. Each case loads the same
checkpoint with ``load_pretrained``, compares the logits, then trains three
AdamW steps on per-dp-rank rows with the global clip: loss and pre-clip
norm per step equal the one-process run on the global batch (fp32), and
the experts' forward saw N/E experts per rank. Finally ``clip_grad_norm``
of one more backward equals torch's ``clip_grad_norm_`` on the whole
one-process model for norm types 2, 1 and inf, and the routers' load
(``RouterStats``: max over mean tokens per expert, per layer) summed over the
ranks equals the one-process count.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
from ray_fsdp_backend.mesh import build_device_mesh, resolve_layout
from ray_fsdp_backend.metrics.router import RouterStats
from ray_fsdp_backend.topology import topology_from_node_counts
from tests.dist.harness import run_ranks

transformers = pytest.importorskip("transformers")

WORLD, STEPS, LR, MAX_NORM = 4, 3, 3e-3, 0.05
BATCH, SEQ, VOCAB, EXPERTS = 4, 12, 96, 8
NORM_TYPES = (2.0, 1.0, math.inf)

# name: (family, expert_parallel_size, hsdp replicate size, force every token to ep rank 0,
#        LoRA on the attention with frozen experts)
CASES = {
    "qwen3_ep2": ("qwen3_moe", 2, None, False, False),
    "qwen3_ep4": ("qwen3_moe", 4, None, False, False),
    "qwen3_hsdp_ep2": ("qwen3_moe", 2, 2, False, False),
    "qwen3_ep2_all_to_rank0": ("qwen3_moe", 2, None, True, False),
    "qwen3_ep2_lora": ("qwen3_moe", 2, None, False, True),
    "mixtral_ep2": ("mixtral", 2, None, False, False),
    "qwen2_shared_ep2": ("qwen2_moe", 2, None, False, False),
}
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def tiny_moe_config(family: str):
    """A two-layer MoE of ``family`` with 8 experts, top-2, fp32 eager."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=EXPERTS, intermediate_size=24, **common)
    extra = dict(num_experts=EXPERTS, moe_intermediate_size=16, intermediate_size=48)
    if family == "qwen2_moe":
        extra.update(shared_expert_intermediate_size=24)
    cls = transformers.AutoConfig.for_model(family).__class__
    return cls(**extra, **common)


def save_moe(family: str, path: str) -> None:
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family))
    with torch.no_grad():  # a router that is not uniform at init
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)


def save_adapter(path: str) -> str:
    """A LoRA adapter for the checkpoint at ``path`` (lora_B not zero, so both
    factors train from the first step), saved beside it; returns its path."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(6)
    model = get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(path), LoraConfig(**LORA)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(f"{path}-lora")
    return f"{path}-lora"


def force_rank0_experts(model: torch.nn.Module, local: int) -> None:
    """Every router picks its top-k among experts ``[0, local)`` only."""

    def hook(module, inputs, output):
        logits = output[0]
        weights, index = torch.topk(F.softmax(logits[:, :local].float(), dim=-1), 2, dim=-1)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), index

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)


def _batches():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (STEPS + 1, BATCH, SEQ + 1), generator=g)
    return tokens[..., :-1], tokens[..., 1:]


def _loss(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())


def _train(model, rows, clip, step_opt):
    """Losses and pre-clip norms of STEPS AdamW steps, then the norms of one
    more backward for every norm type."""
    xs, ys = _batches()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    losses, norms = [], []
    for step in range(STEPS + 1):
        model.zero_grad(set_to_none=True)
        loss = _loss(model, xs[step, rows], ys[step, rows])
        loss.backward()
        losses.append(step_opt(loss))
        if step == STEPS:
            return losses, norms, {p: float(clip(None, p)) for p in NORM_TYPES}
        norms.append(float(clip(MAX_NORM, 2.0)))
        opt.step()


def reference(family: str, path: str, forced: bool, ep: int, lora: bool):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, f"{path}-lora", is_trainable=True)
    if forced:
        force_rank0_experts(model, EXPERTS // ep)
    with torch.no_grad():
        logits = model(_batches()[0][0]).logits
    router = RouterStats(model)

    def clip(max_norm, p):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf, p)

    return (logits, *_train(model, slice(None), clip, lambda loss: loss.item()), router.collect())


def ep_strategy(rank: int, ep: int, replicate: int | None):
    """The fp32 FSDP2 (or HSDP) strategy at ``ep`` on WORLD ranks, its layout and mesh."""
    cfg = FSDPConfig(
        use_fsdp=True,
        fsdp_sharding_strategy="hybrid_shard" if replicate else "full_shard",
        fsdp_hsdp_replicate_size=replicate,
        expert_parallel_size=ep,
        use_mixed_precision=False,
    )
    layout = resolve_layout(cfg, topology_from_node_counts([WORLD]))
    mesh = build_device_mesh(layout, "cpu")
    strategy = build_strategy(cfg, device=torch.device("cpu"), local_rank=rank, mesh=mesh)
    return strategy, layout, mesh


def _run_case(rank, family, ep, replicate, forced, lora, path):
    strategy, layout, mesh = ep_strategy(rank, ep, replicate)
    from ray_fsdp_backend.hf.models import build_causal_lm

    model = build_causal_lm(path)
    seen, rows_seen = [], [0, 0]
    experts_cls = type(next(m for n, m in model.named_modules() if n.endswith("mlp.experts")))
    original = experts_cls.forward

    def recording(self, hidden, index, weights):
        seen.append((tuple(self.gate_up_proj.shape), int(index.max()) if index.numel() else -1))
        rows_seen[0] += hidden.shape[0]
        rows_seen[1] += 1
        return original(self, hidden, index, weights)

    experts_cls.forward = recording
    try:
        if forced:
            force_rank0_experts(model, EXPERTS // ep)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(**LORA))
        model = strategy.wrap(model)
        bytes_read = load_pretrained(model, path).bytes_read
        if lora:
            load_pretrained(model, f"{path}-lora")
        with torch.no_grad():
            logits = model(_batches()[0][0]).logits
        router = RouterStats(model)  # the training steps: each rank routes its own rows
        dp_rank, dp_size = layout.data_parallel_coordinates(rank)
        rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)

        def mean_over_ranks(loss):
            summed = loss.detach().clone()
            dist.all_reduce(summed)
            return float(summed) / WORLD

        def clip(max_norm, p):
            return strategy.clip_grad_norm(model, max_norm, norm_type=p)

        result = (*_train(model, rows, clip, mean_over_ranks), router.collect())
    finally:
        experts_cls.forward = original
    # every rank: ctx.mesh["ep"]'s rank is the pure layout's, and how many rows
    # its experts ran on in how many calls (an empty exchange runs one dummy row)
    share = _weight_bytes(path) / layout.size(("dp_shard", "cp"))
    mine = (
        mesh["ep"].get_local_rank(),
        layout.expert_coordinates(rank)["ep"],
        rows_seen,
        bytes_read / share,
    )
    ranks = [None] * WORLD
    dist.all_gather_object(ranks, mine)
    return (logits, *result, seen, ranks)


def _weight_bytes(path: str) -> int:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # fp32


def _all_cases(rank, world, cases, path_of):
    return {name: _run_case(rank, *case, path_of[case[0]]) for name, case in cases.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    paths = {}
    for family in {case[0] for case in CASES.values()}:
        paths[family] = str(tmp_path_factory.mktemp(family))
        save_moe(family, paths[family])
    save_adapter(paths["qwen3_moe"])
    dist_results = run_ranks(_all_cases, WORLD, CASES, paths)
    refs = {
        name: reference(family, paths[family], forced, ep, lora)
        for name, (family, ep, _, forced, lora) in CASES.items()
    }
    return dist_results, refs


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(results, name):
    dist_results, refs = results
    logits, losses, norms, clip_norms, router, seen, ranks = dist_results[name]
    ref_logits, ref_losses, ref_norms, ref_clip, ref_router = refs[name]
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    assert clip_norms == pytest.approx(ref_clip, rel=1e-4)
    # router load over the global batch, summed over the ranks (ctx.router_stats)
    assert router.keys() == ref_router.keys() == {f"router/layer{i}/max_over_mean" for i in (0, 1)}
    assert router == pytest.approx(ref_router, rel=1e-9)
    assert all(1.0 < r <= EXPERTS for r in router.values())
    ep = CASES[name][1]
    # rank 0's experts forward held N/E experts and saw local expert ids only
    assert {shape[0] for shape, _ in seen} == {EXPERTS // ep}
    assert max(top for _, top in seen) < EXPERTS // ep
    assert all(mesh_rank == pure for mesh_rank, pure, _, _ in ranks)
    assert [pure for _, pure, _, _ in ranks] == [r % ep for r in range(WORLD)]
    if CASES[name][3]:  # only ep rank 0's experts get tokens; the others ran dummies
        assert all((rows == calls) == (pure > 0) for _, pure, (rows, calls), _ in ranks)
    # load_pretrained: each rank read its own experts and dense shard, not more
    assert max(read for *_, read in ranks) <= 1.1, [read for *_, read in ranks]
