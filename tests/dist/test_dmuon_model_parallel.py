"""DMuon beside tensor, context and expert parallelism on 4 gloo ranks,
against one process with ``torch.optim.Muon`` (fp32 Newton–Schulz) on the
block matrices plus ``torch.optim.AdamW`` on the rest, on the global batch.

One spawn runs every layout. Under tp and cp each trains the example decoder
3 steps with the trainer's own ``train_step`` (its loss rule: under cp the
token sum over the global token count, gradients summed by FSDP over
dp_shard x cp), so a change of that rule in one place carries over to
DMuon. Under ep 2 and ep 4 a tiny Qwen3-MoE (8 experts) trains 3 steps with
DMuon's default choice of matrices; the reference runs torch's Muon expert
by expert (each expert's ``gate_up_proj`` / ``down_proj`` its own 2-D
parameter), and a reference that takes each ``[E, out, in]`` stack as one
matrix differs from both.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from torch.optim import _muon as torch_muon

from ray_fsdp_backend.dmuon import Muon
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.runtime.context import set_context
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.trainer.loop.train import train_step
from ray_fsdp_backend.trainer.schema.spec import build_spec
from tests.dist.harness import run_ranks
from tests.dist.test_dmuon import fp32_newton_schulz
from tests.dist.test_expert_parallel import EXPERTS, VOCAB, save_moe

MODEL = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)
ROWS, STEPS = 4, 3
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
LAYOUTS = {"tp2_dp2": (2, 1), "dp_shard2_cp2": (1, 2)}
EP_SIZES = (2, 4)


def global_rows(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, MODEL["vocab_size"], (ROWS, MODEL["seq_len"] + 1), generator=g)


def is_dedicated(name: str, p: torch.Tensor) -> bool:
    return name.startswith("layers.") and p.ndim == 2


class Rows:
    """This dp rank's rows of each step's global batch, as the trainer reads them."""

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.step, self.dp_rank, self.per = 0, dp_rank, ROWS // dp_size

    def next_batch(self):
        rows = global_rows(self.step)[self.dp_rank * self.per : (self.dp_rank + 1) * self.per]
        self.step += 1
        return rows[:, :-1], rows[:, 1:]


def _spec(tp: int, cp: int):
    return build_spec({
        "distributed": {"use_fsdp": True, "use_dmuon": True, "use_mixed_precision": False,
                        "tensor_parallel_size": tp, "context_parallel_size": cp},
        "model": MODEL,
        "train": {"optimizer": "muon", "micro_batch_size": 1, "max_grad_norm": 0},
        "scaling": {"num_workers": 4, "use_gpu": False},
    })  # fmt: skip


def _train_layout(tp: int, cp: int, init: str) -> dict:
    spec = _spec(tp, cp)
    ctx = setup_process_context(spec.distributed, torch.device("cpu"))
    with torch.device("meta"):
        model = Transformer(ModelConfig(**MODEL))
    model = ctx.wrap(model)
    ctx.load_pretrained(model, init)
    adamw = {f"adamw_{k}": v for k, v in ADAMW.items()}
    opt = Muon(model, **MUON, **adamw, ns_dtype=torch.float32, is_dedicated=is_dedicated)
    batches = Rows(ctx.dp_rank, ctx.dp_size)
    for _ in range(STEPS):
        train_step(ctx, model, opt, batches, spec)
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    set_context(None)
    split = opt.tensor_split
    return {"params": params, "tp_split": (split.size, set(split.dims)),
            "shard_group": opt.shard_group.size}  # fmt: skip


def moe_rows(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(70 + step)
    return torch.randint(0, VOCAB, (ROWS, 13), generator=g)


def _train_experts(rank: int, ep: int, path: str) -> dict:
    """3 DMuon steps of the MoE at ``ep`` (default matrices: the experts'
    stacks among them), each dp rank on its rows of the global batch."""
    from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
    from ray_fsdp_backend.distributed.mesh import build_device_mesh, resolve_layout
    from ray_fsdp_backend.hf.models import build_causal_lm
    from ray_fsdp_backend.planning.topology import topology_from_node_counts

    cfg = FSDPConfig(use_fsdp=True, use_dmuon=True, expert_parallel_size=ep,
                     use_mixed_precision=False)  # fmt: skip
    layout = resolve_layout(cfg, topology_from_node_counts([4]))
    mesh = build_device_mesh(layout, "cpu")
    strategy = build_strategy(cfg, device=torch.device("cpu"), local_rank=rank, mesh=mesh)
    model = strategy.wrap(build_causal_lm(path))
    load_pretrained(model, path)
    adamw = {f"adamw_{k}": v for k, v in ADAMW.items()}
    opt = Muon(model, **MUON, **adamw, ns_dtype=torch.float32)
    dp_rank, dp_size = layout.data_parallel_coordinates(rank)
    per = ROWS // dp_size
    for step in range(STEPS):
        rows = moe_rows(step)[dp_rank * per : (dp_rank + 1) * per]
        logits = model(rows[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    stats = opt.last_step_stats
    mine = (layout.expert_coordinates(rank)["ep"],
            [n for n in stats.orthogonalized if ".experts." in n], stats.bytes_sent)  # fmt: skip
    ranks = [None] * 4
    torch.distributed.all_gather_object(ranks, mine)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "ranks": ranks, "strategy": type(strategy).__name__,
            "planned": [m.name for m in opt.plan.matrices]}  # fmt: skip


def on_ranks(rank: int, world_size: int, init: str, moe: str, gpt_oss: str) -> dict:
    runs = {name: _train_layout(tp, cp, init) for name, (tp, cp) in LAYOUTS.items()}
    runs.update({f"ep{ep}": _train_experts(rank, ep, moe) for ep in EP_SIZES})
    runs["gpt_oss_ep2"] = _train_experts(rank, 2, gpt_oss)
    return runs


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("dmuon_mp") / "init.safetensors")
    state = Transformer(ModelConfig(**MODEL)).state_dict()
    save_file({k: v.clone() for k, v in state.items() if k != "output.weight"}, path)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dmuon_moe"))
    save_moe("qwen3_moe", path)
    return path


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    """A tiny gpt-oss (4 experts with 2-D bias stacks ``[E, 2I]``, nonzero)."""
    from tests.unit.test_dmuon_stacks import tiny_gpt_oss

    path = str(tmp_path_factory.mktemp("dmuon_gpt_oss"))
    tiny_gpt_oss().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(init, moe, gpt_oss):
    return run_ranks(on_ranks, 4, init, moe, gpt_oss)


def _initial(init: str) -> Transformer:
    model = Transformer(ModelConfig(**MODEL))
    model.load_state_dict(load_file(init), strict=False)
    return model


@pytest.fixture(scope="module")
def reference(init) -> tuple[dict, dict]:
    """The initial and the final parameters of one process on the global batch."""
    model = _initial(init)
    named = list(model.named_parameters())
    first = {n: p.detach().clone() for n, p in named}
    muon = torch.optim.Muon([p for n, p in named if is_dedicated(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_dedicated(n, p)], **ADAMW)
    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz):
        for step in range(STEPS):
            rows = global_rows(step)
            logits = model(rows[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
    return first, {n: p.detach().clone() for n, p in named}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dmuon_equals_torch_muon_on_the_whole_model(runs, reference, layout):
    first, want = reference
    got = runs[layout]["params"]
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5, msg=name)
    moved = max(float((want[n] - first[n]).abs().max()) for n in want if is_dedicated(n, want[n]))
    assert moved > 1e-3  # Muon moved the matrices: the comparison can fail


def test_matrices_stay_split_over_tp_and_owners_span_the_fsdp_mesh(runs):
    # tp 2 x dp 2: column- and row-wise TP blocks, owners over dp_shard (2);
    # dp_shard 2 x cp 2: no tp, owners over dp_shard x cp (4), as FSDP shards.
    assert runs["tp2_dp2"]["tp_split"] == (2, {0, 1})
    assert runs["tp2_dp2"]["shard_group"] == 2
    assert runs["dp_shard2_cp2"]["tp_split"] == (1, {None})
    assert runs["dp_shard2_cp2"]["shard_group"] == 4


def _moe_reference(path: str, per_expert: bool) -> tuple[dict, dict]:
    """The initial and final parameters of one process: torch's Muon on the
    blocks' 2-D weights and on every expert's matrix as its own parameter
    (``per_expert``), or on each ``[E, out, in]`` stack taken as one
    ``[E * out, in]`` matrix; AdamW on the rest (the experts' bias stacks
    ``[E, out]`` among it)."""
    model = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(path)
    named = list(model.named_parameters())
    first = {n: p.detach().clone() for n, p in named}
    stacks = [p for n, p in named if p.ndim == 3]
    views = [list(p.detach()) if per_expert else [p.detach().flatten(0, 1)] for p in stacks]
    proxies = [[torch.nn.Parameter(v.clone()) for v in vs] for vs in views]
    biases = {n for n, p in named if ".experts." in n and p.ndim == 2}
    matrices = [
        p for n, p in named if n.startswith("model.layers.") and p.ndim == 2 and n not in biases
    ]
    muon = torch.optim.Muon(matrices + [q for qs in proxies for q in qs], **MUON)
    rest = [p for n, p in named if p.ndim == 1 or "layers" not in n or n in biases]
    adamw = torch.optim.AdamW(rest, **ADAMW)
    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz):
        for step in range(STEPS):
            rows = moe_rows(step)
            logits = model(rows[:, :-1]).logits
            F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
            for p, qs in zip(stacks, proxies, strict=True):
                grads = list(p.grad) if per_expert else [p.grad.flatten(0, 1)]
                for q, g in zip(qs, grads, strict=True):
                    q.grad = g.clone()
            muon.step()
            adamw.step()
            with torch.no_grad():
                for p, qs in zip(stacks, proxies, strict=True):
                    p.copy_(torch.stack([q for q in qs]).view_as(p))
            model.zero_grad()  # the stacks too: no optimizer holds them
    return first, {n: p.detach().clone() for n, p in named}


@pytest.fixture(scope="module")
def moe_reference(moe) -> tuple[dict, dict, dict]:
    """Initial parameters, final ones expert by expert, and final ones with
    each stack as one matrix."""
    first, want = _moe_reference(moe, per_expert=True)
    return first, want, _moe_reference(moe, per_expert=False)[1]


@pytest.mark.parametrize("ep", EP_SIZES)
def test_dmuon_with_experts_equals_torch_muon_expert_by_expert(runs, moe_reference, ep):
    run = runs[f"ep{ep}"]
    first, want, as_one_matrix = moe_reference
    assert run["strategy"] == "DMuonFSDPStrategy"
    assert set(run["params"]) == set(want)
    for name in want:
        torch.testing.assert_close(run["params"][name], want[name], rtol=1e-4, atol=2e-5, msg=name)
    experts = [n for n in want if ".experts." in n]
    assert len(experts) == 4  # gate_up_proj and down_proj of 2 layers
    # the comparison can fail: Muon moved the experts, and a stack taken as
    # one matrix lands elsewhere
    assert min(float((want[n] - first[n]).abs().max()) for n in experts) > 1e-3
    assert min(float((want[n] - as_one_matrix[n]).abs().max()) for n in experts) > 1e-3


def test_each_expert_is_orthogonalised_once_where_it_lives(runs):
    for ep in EP_SIZES:
        run = runs[f"ep{ep}"]
        # the exchange plans the dense matrices only: no expert bytes travel
        assert run["planned"] and not any(".experts." in n for n in run["planned"])
        names = [n for _, owned, _ in run["ranks"] for n in owned]
        assert len(names) == len(set(names)) == 4 * EXPERTS
        local = EXPERTS // ep
        for ep_rank, owned, _ in run["ranks"]:
            held = {int(n.rsplit("[", 1)[1][:-1]) for n in owned}
            assert held <= set(range(ep_rank * local, (ep_rank + 1) * local)), (ep, held)
    # the same dense exchange at ep 2 and ep 4: ep adds no DMuon traffic
    assert [b for *_, b in runs["ep2"]["ranks"]] == [b for *_, b in runs["ep4"]["ranks"]]


def test_dmuon_at_ep2_leaves_gpt_oss_bias_stacks_to_adamw(runs, gpt_oss):
    """gpt-oss at ep 2 (refused before with an unrelated message): each
    expert's matrix by torch's Muon, the 2-D bias stacks by AdamW."""
    run = runs["gpt_oss_ep2"]
    first, want = _moe_reference(gpt_oss, per_expert=True)
    assert set(run["params"]) == set(want)
    for name in want:
        torch.testing.assert_close(run["params"][name], want[name], rtol=1e-4, atol=2e-5, msg=name)
    biases = [n for n in want if n.endswith("_proj_bias")]
    assert len(biases) == 4 and min(float((want[n] - first[n]).abs().max()) for n in biases) > 1e-4
    names = [n for _, owned, _ in run["ranks"] for n in owned]
    assert sorted(names) == sorted(f"{s}[{e}]" for s in _stacks(want) for e in range(4))


def _stacks(params: dict) -> list[str]:
    return [n for n, p in params.items() if p.ndim == 3]
