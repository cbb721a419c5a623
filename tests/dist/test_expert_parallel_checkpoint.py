"""Sharded checkpoints and exports across expert-parallel degrees on 4 gloo ranks.

One spawn: a tiny Qwen3-MoE trained two AdamW steps at ep 2 (experts
FSDP-sharded over efsdp 2) is saved, then loaded at ep 1 (plain FSDP2), at
ep 4 and under HSDP (2 x dp_shard 2, ep 2): parameters and AdamW moments
exactly as saved (DCP reshards the experts' ``(efsdp, ep)`` DTensors). The
ep 2 model (and a Mixtral at ep 2) is exported: the key set is exactly the
one ``save_pretrained`` writes (per-expert keys), and ``from_pretrained``
reads back the trained weights.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from ray_fsdp_backend import load_pretrained
from ray_fsdp_backend.checkpoint import CheckpointStore, find_latest, load_sharded, save_sharded
from ray_fsdp_backend.hf import export_model
from ray_fsdp_backend.hf.models import build_causal_lm
from tests.dist.harness import run_ranks
from tests.dist.test_expert_parallel import VOCAB, Case, ep_strategy, save_moe
from tests.dist.test_tensor_parallel_checkpoint import _full_state

transformers = pytest.importorskip("transformers")

WORLD, BATCH, SEQ = 4, 4, 12
LAYOUTS = {  # name: (expert_parallel_size, hsdp replicate size)
    "ep2": (2, None),
    "ep1": (1, None),
    "ep4": (4, None),
    "hsdp_ep2": (2, 2),
}


def _wrap(rank, name, path):
    ep, replicate = LAYOUTS[name]
    strategy, layout, _ = ep_strategy(rank, Case("layout only", ep, replicate))
    model = strategy.wrap(build_causal_lm(path))
    torch.manual_seed(100 + len(name))  # a different start each time: the load overwrites it
    for p in model.parameters():
        torch.nn.init.normal_(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, layout.data_parallel_coordinates(rank)


def _step(model, opt, dp, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    dp_rank, dp_size = dp
    rows = tokens[dp_rank * BATCH // dp_size : (dp_rank + 1) * BATCH // dp_size]
    logits = model(rows[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()


def _chain(rank, world, root, paths):
    store = CheckpointStore.local(os.path.join(root, "run"))
    model, opt, dp = _wrap(rank, "ep2", paths["qwen3_moe"])
    load_pretrained(model, paths["qwen3_moe"])
    for step in range(2):
        _step(model, opt, dp, step)
    save_sharded(store, model, opt, extra_state={"step": 2})
    saved = _full_state(model, opt)
    export_model(model, os.path.join(root, "export_qwen3_moe"))
    loaded = {}
    for name in ("ep1", "ep4", "hsdp_ep2"):
        model, opt, dp = _wrap(rank, name, paths["qwen3_moe"])
        assert load_sharded(store, find_latest(store), model, opt) == {"step": 2}
        loaded[name] = _full_state(model, opt)
    mixtral, _, _ = _wrap(rank, "ep2", paths["mixtral"])
    load_pretrained(mixtral, paths["mixtral"])
    export_model(mixtral, os.path.join(root, "export_mixtral"))
    return saved, loaded


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("epckpt"))
    paths = {}
    for family in ("qwen3_moe", "mixtral"):
        paths[family] = os.path.join(root, family)
        save_moe(family, paths[family])
    return (*run_ranks(_chain, WORLD, root, paths), root, paths)


@pytest.mark.parametrize("name", ["ep1", "ep4", "hsdp_ep2"])
def test_every_layout_loads_exactly_what_ep2_saved(chain, name):
    saved, loaded, _, _ = chain
    assert loaded[name].keys() == saved.keys()
    assert any(k.endswith("experts.gate_up_proj/exp_avg_sq") for k in saved)
    for key, value in saved.items():
        torch.testing.assert_close(loaded[name][key], value, atol=0, rtol=0, msg=key)


def _weight_keys(path: str) -> set[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_export_writes_save_pretrained_keys_and_reads_back(chain, family):
    saved, _, root, paths = chain
    exported = os.path.join(root, f"export_{family}")
    assert _weight_keys(exported) == _weight_keys(paths[family])
    assert any(".experts.7." in k for k in _weight_keys(exported))
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    if family == "qwen3_moe":  # the trained ep 2 weights
        expected = {k.removeprefix("param/"): v for k, v in saved.items() if "param/" in k}
    else:  # the pretrained ones, through the ep 2 split
        expected = transformers.AutoModelForCausalLM.from_pretrained(paths[family]).state_dict()
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, atol=0, rtol=0, msg=key)
