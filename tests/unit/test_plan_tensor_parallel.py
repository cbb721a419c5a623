"""``ray-fsdp plan`` with tensor parallelism and a transformers config.json:
the 3-D mesh, each axis's rank groups, per-GPU memory split over tp x dp_shard,
and the refusals (no cluster, no model built)."""

from __future__ import annotations

import json
import re

import pytest

from ray_fsdp_backend.cli.main import main
from ray_fsdp_backend.planning.memory import format_bytes

LLAMA3 = {size: f"examples/llama3_{size}.config.json" for size in ("8b", "70b")}
PARAMS = {"8b": 8_030_261_248, "70b": 70_553_706_496}


def _plan(capsys, tmp_path, size, nodes, *sets):
    path = LLAMA3[size]
    argv = [
        "plan",
        "examples/fsdp_1node_8gpu.yaml",
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        "8",
        "--hf-config",
        str(path),
        "--set",
        "distributed.tensor_parallel_size=8",
    ]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 0
    return capsys.readouterr().out


def _groups(out: str, axis: str) -> list[str]:
    block = re.search(rf"^{axis} groups \(\d+;.*?\n((?:  .*\n)+)", out, re.M)
    return block.group(1).split() if block else []


@pytest.mark.parametrize("size, nodes", [("8b", 1), ("70b", 4)])
def test_llama3_at_tp8_on_8_gpu_nodes(capsys, tmp_path, size, nodes):
    out = _plan(capsys, tmp_path, size, nodes)
    # Size-one axes left out: the 8B plan on one node is (tp=8).
    assert ("mesh:     (tp=8)" if nodes == 1 else f"mesh:     (dp_shard={nodes}, tp=8)") in out
    assert ("dp_shard groups" in out) == (nodes > 1)
    assert _groups(out, "tp") == [f"[{8 * n}-{8 * n + 7}]" for n in range(nodes)]
    if nodes > 1:  # dp_shard groups: one rank of each node, same tp position
        assert out.count("\n  [0, 8, 16, 24]\n") == 1
    assert f"model:    {PARAMS[size] / 1e6:,.1f}M parameters" in out
    # fp32 parameters split over tp x dp_shard = 8 x nodes.
    params = re.search(r"  parameters\s+(.+)\n", out).group(1).strip()
    assert params == format_bytes(-(-4 * PARAMS[size] // (8 * nodes)))
    assert f"split over tp=8 x dp_shard={nodes}" in out


def test_sequence_parallel_divides_activations_by_tp(capsys, tmp_path):
    on = _plan(capsys, tmp_path, "8b", 1, "distributed.use_gradient_checkpointing=false")
    off = _plan(
        capsys,
        tmp_path,
        "8b",
        1,
        "distributed.use_gradient_checkpointing=false",
        "distributed.sequence_parallel=false",
    )
    flash = [re.search(r"\n\s+(\S+ \S+)  flash", o).group(1) for o in (on, off)]
    assert flash[0] != flash[1]


def test_plan_states_tp_bytes_per_block(capsys, tmp_path):
    """The bytes tests/dist/test_tp_traffic.py counts: per block and micro-batch
    ``8 (T - 1) / T`` activations of ``rows x seq x dim`` values with or without
    sequence parallelism, ``11`` and ``10`` with checkpointing (recompute)."""
    hf = json.loads(open(LLAMA3["8b"]).read())
    plain = "distributed.use_gradient_checkpointing=false"
    sp_off = "distributed.sequence_parallel=false"
    runs = {
        "sp": ([plain], 8, "4 all-gathers + 4 reduce-scatters: forward, backward"),
        "no_sp": ([plain, sp_off], 8, "4 all-reduces: forward, backward"),
        "sp_checkpointed": ([], 11, "6 all-gathers + 5 reduce-scatters: forward, recompute"),
        "checkpointed": ([sp_off], 10, "5 all-reduces: forward, recompute, backward"),
    }
    for sets, units, kinds in runs.values():
        out = _plan(capsys, tmp_path, "8b", 1, *sets)
        batch = re.search(r"traffic per rank, one micro-batch of (\d+) x (\d+) tokens", out)
        rows, seq = int(batch.group(1)), int(batch.group(2))
        activation = rows * seq * hf["hidden_size"] * 2  # bf16 activations
        sent = units * activation * 7 // 8  # tp 8: a ring sends 7 / 8 per unit
        per_block = re.search(r"\n\s+(\S+ \S+)  per block \((.*)\)", out)
        assert per_block.group(1) == format_bytes(sent), out
        assert per_block.group(2).startswith(kinds)
        blocks = re.search(r"\n\s+(\S+ \S+)  all (\d+) blocks", out)
        assert blocks.group(1) == format_bytes(sent * hf["num_hidden_layers"])


def test_tp_that_does_not_divide_the_heads_is_refused(capsys, tmp_path):
    path = tmp_path / "odd.json"
    path.write_text(
        json.dumps(
            {
                **json.loads(open(LLAMA3["8b"]).read()),
                "num_attention_heads": 36,
                "num_key_value_heads": 12,
                "hidden_size": 4608,
            }
        )
    )
    argv = ["plan", "examples/fsdp_1node_8gpu.yaml", "--gpus-per-node"]
    tp8 = ["--set", "distributed.tensor_parallel_size=8"]
    assert main([*argv, "8", "--nodes", "1", "--hf-config", str(path), *tp8]) != 0
    assert re.search(
        r"tensor_parallel_size=8 does not divide model.n_heads=36, model.n_kv_heads=12",
        capsys.readouterr().err,
    )
    assert main([*argv, "4", "--nodes", "2", *tp8]) != 0
    assert "tensor_parallel_size=8 needs groups of 8 ranks" in capsys.readouterr().err


def test_training_config_refuses_tp_the_model_or_data_cannot_take():
    from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, load_yaml

    doc = load_yaml("examples/cpu_tiny.yaml")
    tp = ["distributed.use_fsdp=true", "distributed.tensor_parallel_size=8"]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 does not divide model.n_heads=4"):
        build_spec(apply_overrides(doc, tp))
    # Ray Data is split by dp rank (rfb.MeshDataConfig): tp groups read the same rows.
    tp2 = [tp[0], "distributed.tensor_parallel_size=2"]
    assert build_spec(apply_overrides(doc, [*tp2, "data.source=ray_data", "data.path=/x"]))
    assert build_spec(apply_overrides(doc, [tp[0], "distributed.tensor_parallel_size=2"]))
