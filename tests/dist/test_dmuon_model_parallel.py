"""DMuon beside tensor and context parallelism on 4 gloo ranks, against
one process with ``torch.optim.Muon`` (fp32 Newton–Schulz) on the block
matrices plus ``torch.optim.AdamW`` on the rest, on the global batch.

One spawn runs every layout. Each trains the example decoder 3 steps with
the trainer's own ``train_step`` (its loss rule: under cp the token sum over
the global token count, gradients summed by FSDP over dp_shard x cp), so a
change of that rule in one place carries over to DMuon.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from torch.optim import _muon as torch_muon

from ray_fsdp_backend._worker import setup_process_context
from ray_fsdp_backend.context import set_context
from ray_fsdp_backend.dmuon import Muon
from ray_fsdp_backend.trainer.model import ModelConfig, Transformer
from ray_fsdp_backend.trainer.spec import build_spec
from ray_fsdp_backend.trainer.train import train_step
from tests.dist.harness import run_ranks
from tests.dist.test_dmuon import fp32_newton_schulz

MODEL = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)
ROWS, STEPS = 4, 3
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
LAYOUTS = {"tp2_dp2": (2, 1), "dp_shard2_cp2": (1, 2)}


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


def on_ranks(rank: int, world_size: int, init: str) -> dict:
    return {name: _train_layout(tp, cp, init) for name, (tp, cp) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("dmuon_mp") / "init.safetensors")
    state = Transformer(ModelConfig(**MODEL)).state_dict()
    save_file({k: v.clone() for k, v in state.items() if k != "output.weight"}, path)
    return path


@pytest.fixture(scope="module")
def runs(init):
    return run_ranks(on_ranks, 4, init)


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
