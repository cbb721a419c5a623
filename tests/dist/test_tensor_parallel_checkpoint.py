"""Sharded checkpoints across tensor-parallel degrees on 4 gloo ranks.

One spawn: the example decoder trained at tp 2 x dp 2 is saved, loaded at
tp 1 x dp 4 (exactly the saved parameters and AdamW moments), trained a step
there (equal to the tp 2 run's next step), saved, loaded at tp 4 x dp 1,
saved, and loaded back at HSDP 2 x (1 x 2). DCP reshards the 2-D
``(_StridedShard, Shard)`` parameters each time. ``export_model`` from the
tp 2 x dp 2 model writes the full tensors, and logs none of torch's
redistribute warnings (``full_tensor`` of a ``(_StridedShard, Shard)``
parameter logs "2 sequential all_gather operations" on every rank).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from ray_fsdp_backend import FSDPConfig, build_strategy
from ray_fsdp_backend.checkpoint import CheckpointStore, find_latest, load_sharded, save_sharded
from ray_fsdp_backend.distributed.mesh import build_device_mesh, resolve_layout
from ray_fsdp_backend.hf import export_model
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.planning.topology import topology_from_node_counts
from tests.dist.harness import run_ranks

WORLD, SEQ, BATCH = 4, 16, 4
MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, seq_len=SEQ)
LAYOUTS = {  # name: (tensor_parallel_size, strategy, hsdp replicate size)
    "tp2_dp2": (2, "full_shard", None),
    "tp1_dp4": (1, "full_shard", None),
    "tp4_dp1": (4, "full_shard", None),
    "hsdp_2x(1x2)": (2, "hybrid_shard", 2),
}


def _wrap(rank, name):
    tp, strategy_name, replicate = LAYOUTS[name]
    cfg = FSDPConfig(
        use_fsdp=True,
        fsdp_sharding_strategy=strategy_name,
        fsdp_hsdp_replicate_size=replicate,
        tensor_parallel_size=tp,
        use_mixed_precision=False,
    )
    layout = resolve_layout(cfg, topology_from_node_counts([WORLD]))
    mesh = build_device_mesh(layout, "cpu")
    strategy = build_strategy(cfg, device=torch.device("cpu"), local_rank=rank, mesh=mesh)
    torch.manual_seed(100 + len(name))  # a different init each time: the load overwrites it
    with torch.device("meta"):
        model = strategy.wrap(Transformer(MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, layout.data_parallel_coordinates(rank)


def _step(model, opt, dp, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=g)
    dp_rank, dp_size = dp
    rows = tokens[dp_rank * BATCH // dp_size : (dp_rank + 1) * BATCH // dp_size]
    loss = model.loss(rows[:, :-1], rows[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True)
    out = {f"param/{k}": v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, opt, options=options)
    for fqn, state in optim["state"].items():
        out.update({f"optim/{fqn}/{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _reshard_chain(rank, world, root):
    store = CheckpointStore.local(os.path.join(root, "run"))
    model, opt, dp = _wrap(rank, "tp2_dp2")
    for step in range(2):
        _step(model, opt, dp, step)
    save_sharded(store, model, opt, extra_state={"step": 2})
    saved = {"tp2_dp2": _full_state(model, opt)}
    _export_quietly(model, os.path.join(root, "export.safetensors"))
    _step(model, opt, dp, 2)
    after = _full_state(model, opt)
    loaded, stepped = {}, None
    for name in ("tp1_dp4", "tp4_dp1", "hsdp_2x(1x2)"):
        model, opt, dp = _wrap(rank, name)
        extra = load_sharded(store, find_latest(store), model, opt)
        assert extra == {"step": 2}
        loaded[name] = _full_state(model, opt)
        if name == "tp1_dp4":
            _step(model, opt, dp, 2)
            stepped = _full_state(model, opt)
            # Save the pre-step state again, from this layout: the next load reads it.
            model, opt, dp = _wrap(rank, name)
            load_sharded(store, find_latest(store), model, opt)
        save_sharded(store, model, opt, extra_state={"step": 2})
    return saved["tp2_dp2"], loaded, after, stepped


def _export_quietly(model, path):
    """``export_model`` on this rank logs nothing through torch's
    redistribute logger. Torch warns once per mesh: the set of meshes it
    warned about (private, torch 2.13) is emptied first."""
    from torch.distributed.tensor import _redistribute

    _redistribute._warned_flatten_issues.clear()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(_redistribute.__name__)
    logger.addHandler(handler)
    try:
        export_model(model, path)
    finally:
        logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tpckpt"))
    return (*run_ranks(_reshard_chain, WORLD, root), root)


@pytest.mark.parametrize("name", ["tp1_dp4", "tp4_dp1", "hsdp_2x(1x2)"])
def test_every_layout_loads_exactly_what_tp2_dp2_saved(chain, name):
    saved, loaded, _, _, _ = chain
    assert loaded[name].keys() == saved.keys()
    assert any(k.endswith("exp_avg_sq") for k in saved)
    for key, value in saved.items():
        torch.testing.assert_close(loaded[name][key], value, atol=0, rtol=0, msg=key)


def test_training_continues_identically_after_resharding(chain):
    _, _, after, stepped, _ = chain
    for key, value in after.items():
        torch.testing.assert_close(stepped[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_export_writes_full_tensors_from_tp_shards(chain):
    from safetensors.torch import load_file

    saved, _, _, _, root = chain
    exported = load_file(os.path.join(root, "export.safetensors"))
    params = {k.removeprefix("param/"): v for k, v in saved.items() if k.startswith("param/")}
    assert exported.keys() >= params.keys() - {"output.weight"}  # the tied head once or twice
    for key, value in exported.items():
        torch.testing.assert_close(value, params[key], atol=0, rtol=0, msg=key)
