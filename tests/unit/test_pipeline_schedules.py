"""Virtual pipeline stages (issue 47): where torch's schedules place each
rank's stages, what they refuse before any worker starts, their bubble and
activations in flight, and the split of one model into a rank's stages."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.pipeline.split import pipeline_roots, split_for_stage, split_for_stages
from ray_fsdp_backend.planning.pipeline_layout import format_pipeline_plan
from ray_fsdp_backend.planning.pipeline_plan import in_flight
from ray_fsdp_backend.planning.pipeline_schedules import bubble_fraction, stage_indices
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.settings.pipeline_schedules import schedule_errors


@pytest.mark.parametrize("pp, virtual", [(2, 2), (4, 2), (3, 3)])
def test_loop_placement_is_torchs(pp, virtual):
    mapping = generate_stage_to_rank_mapping(pp, pp * virtual)  # loop style
    for rank in range(pp):
        held = stage_indices(rank, pp, virtual, "interleaved_1f1b")
        assert held == tuple(s for s, r in sorted(mapping.items()) if r == rank)


@pytest.mark.parametrize("pp", [2, 4])
def test_v_placement_is_torchs(pp):
    mapping = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
    for rank in range(pp):
        held = stage_indices(rank, pp, 2, "zbv_zero_bubble")
        assert held == tuple(s for s, r in sorted(mapping.items()) if r == rank)
        assert held == (rank, 2 * pp - 1 - rank)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(pipeline_schedule="1f1b", pipeline_virtual_stages=2), "runs one stage per rank"),
        (dict(pipeline_schedule="interleaved_1f1b"), "at least 2 stages per rank"),
        (
            # measured: torch 2.13's ZBV eval() fails on a rank's locally linked stages
            dict(pipeline_schedule="zbv_zero_bubble", pipeline_virtual_stages=2),
            "zbv_zero_bubble' is refused: .* eval",
        ),
        (
            # torch: rounds = max(1, 5 // 2) = 2, and 5 % 2 != 0
            dict(
                pipeline_schedule="interleaved_zero_bubble",
                pipeline_virtual_stages=2,
                pipeline_microbatches=5,
            ),
            r"multiple of max\(1, M // P\) = 2",
        ),
        (dict(pipeline_virtual_stages=0), "must be a positive int"),
    ],
)
def test_virtual_stage_settings_are_refused_by_name(settings, words):
    with pytest.raises(ValueError, match=words):
        FSDPSettings(use_fsdp=True, pipeline_parallel_size=2, **settings)


def test_virtual_stages_need_pipeline_parallelism():
    with pytest.raises(ValueError, match="pipeline_virtual_stages=2"):
        FSDPSettings(pipeline_virtual_stages=2, pipeline_schedule="interleaved_1f1b")


def test_accepted_schedules():
    for schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        FSDPSettings(
            use_fsdp=True,
            pipeline_parallel_size=2,
            pipeline_schedule=schedule,
            pipeline_virtual_stages=2,
        )
    assert schedule_errors("interleaved_1f1b", 4, 2, 3) == []  # torch: 1 round of 3


def test_bubble_per_schedule():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, "gpipe") == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, "interleaved_1f1b", 2) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 8, "interleaved_zero_bubble", 2) == pytest.approx(3 / 51)
    assert bubble_fraction(4, 8, "zbv_zero_bubble", 2) == 0.0


def test_in_flight_per_schedule():
    # torch's warm-up: (V - 1) * M / rounds + 2 (P - 1 - r) forwards, then one more.
    assert [in_flight("interleaved_1f1b", r, 4, 8, 2) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert in_flight("interleaved_1f1b", 0, 4, 1, 2) == 1  # capped at V * M stage forwards
    # ZBV: 2 (P - r) - 1 forwards of the first stage, r of the second, one more.
    assert [in_flight("zbv_zero_bubble", r, 4, 8, 2) for r in range(4)] == [4, 3.5, 3, 2.5]


def test_plan_names_each_ranks_stages():
    lines = format_pipeline_plan(2, 5, "zbv_zero_bubble", 4, [(0, 2)], virtual=2)
    assert "4 stages (0: layers 0-0 + embedding; 1: layers 1-1; 2: layers 2-3;" in lines[0]
    assert "{0: [0, 3], 1: [1, 2]}" in lines[0] and "bubble 0.0%" in lines[0]


def _decoder(n_layers=5) -> Transformer:
    cfg = ModelConfig(
        dim=16, n_layers=n_layers, n_heads=2, seq_len=8, vocab_size=32, tie_embeddings=False
    )
    with torch.device("meta"):
        return Transformer(cfg)


def test_a_rank_holds_the_union_of_its_stages_under_original_names():
    # V shape: first and last stage, an explicit split (balanced would be 1, 1, 2, 1)
    model = split_for_stages(_decoder(), (0, 3), 4, [2, 1, 1, 1])
    names = {n for n, _ in model.named_parameters()}
    assert "tok_embeddings.weight" in names and "output.weight" in names
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "1", "4"}
    first, last = pipeline_roots(model)
    assert first.layers is not model.layers and first.output is None and last.tok_embeddings is None
    # The stages' modules share the rank model's layers and ends, not copies.
    assert first.layers._modules["1"] is model.layers._modules["1"]
    assert last.output is model.output and first.tok_embeddings is model.tok_embeddings
    assert set(dict(first.named_parameters())) | set(dict(last.named_parameters())) == names
    assert pipeline_roots(split_for_stage(_decoder(), 1, 4, [2, 1, 1, 1])) != [first]
    with pytest.raises(RuntimeError, match="ctx.pipeline_step"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_more_stages_than_layers_names_both_keys():
    with pytest.raises(ValueError, match="pipeline_virtual_stages.*exceeds the model's 3"):
        split_for_stages(_decoder(3), (0, 2), 4)
