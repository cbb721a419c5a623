"""``ray-fsdp plan`` prints what the backend does: shard groups under cp as
its memory figures count them, the batch each layout trains, the elastic
activation estimate for the micro-batch it prints."""

from __future__ import annotations

import re
from pathlib import Path

from ray_fsdp_backend.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _plan(capsys, example: str, nodes: int, gpus: int, *sets: str) -> str:
    argv = ["plan", str(EXAMPLES / example), "--nodes", str(nodes), "--gpus-per-node", str(gpus)]
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    return capsys.readouterr().out


def test_cp_shard_groups_are_dp_shard_x_cp_like_the_memory(capsys):
    out = _plan(capsys, "long_context.yaml", 1, 4)
    assert "mesh:     (dp_shard=2, cp=2)" in out
    assert "dp_shard x cp groups (1; parameters split among these ranks" in out
    assert "\ndp_shard groups" not in out
    assert "cp groups (2; each sequence split" in out


def test_tp_without_more_workers_says_the_batch_it_trains(capsys):
    plain = _plan(capsys, "cpu_tiny.yaml", 1, 2)
    tp = _plan(capsys, "cpu_tiny.yaml", 1, 2, "distributed.tensor_parallel_size=2")
    assert "batch:    global batch 16 = micro-batch 8 x 1 accumulation step(s) x 2 dp" in plain
    assert "batch:    global batch 8 = micro-batch 8 x 1 accumulation step(s) x 1 dp" in tp
    assert "(tp 2 ranks share each row; set train.global_batch_size" in tp


def test_elastic_activations_use_the_printed_micro_batch(capsys):
    out = _plan(capsys, "elastic_spot.yaml", 1, 4)
    micros = []
    for section in out.split("\n== ")[1:]:
        micro = re.search(r"batch:  .* x (\d+) samples", section).group(1)
        assert f"one micro-batch of {micro} x " in section, section
        micros.append(micro)
    assert micros == ["4", "3"]  # 192 over 16 ranks: 3 x 4; over 32: 2 x 3
