"""Pipeline parallelism's pure parts (issue 47): config refusals, the mesh
with ``pp`` outermost, the stage plan, the split's names and refusals."""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.distributed.mesh import resolve_layout
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.pipeline import bubble_fraction, plan_stages, resolve_microbatches
from ray_fsdp_backend.pipeline.split import split_for_stage
from ray_fsdp_backend.planning.pipeline_layout import balanced_split
from ray_fsdp_backend.planning.topology import compute_topology_from_env, topology_from_node_counts
from ray_fsdp_backend.settings.config import FSDPSettings


def _settings(**kw) -> FSDPSettings:
    return FSDPSettings(use_fsdp=True, pipeline_parallel_size=2, **kw)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(use_fsdp=False, pipeline_parallel_size=2), "needs use_fsdp"),
        (dict(use_fsdp=True, pipeline_parallel_size=0), "pipeline_parallel_size=0"),
        (dict(use_fsdp=True, pipeline_schedule="zbv"), "pipeline_schedule='zbv'"),
        (dict(use_fsdp=True, pipeline_microbatches=0), "pipeline_microbatches=0"),
        (
            dict(use_fsdp=True, pipeline_parallel_size=4, pipeline_microbatches=2),
            "pipeline_microbatches=2 < pipeline_parallel_size=4",
        ),
        (
            dict(use_fsdp=True, pipeline_parallel_size=2, context_parallel_size=2),
            "context_parallel_size=2",
        ),
        (dict(use_fsdp=True, pipeline_parallel_size=2, use_dmuon=True), "use_dmuon"),
        (
            dict(
                use_fsdp=True,
                pipeline_parallel_size=2,
                tensor_parallel_size=2,
                sequence_parallel=True,
            ),
            "sequence_parallel=true",
        ),
    ],
)
def test_config_refusals_name_the_key(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        FSDPSettings(**kw)


def test_sequence_parallel_defaults_off_under_pp():
    assert not _settings(tensor_parallel_size=2).sequence_parallel_enabled
    assert FSDPSettings(use_fsdp=True, tensor_parallel_size=2).sequence_parallel_enabled


def test_gpipe_takes_fewer_microbatches_than_stages():
    cfg = _settings(pipeline_schedule="gpipe", pipeline_microbatches=1)
    assert FSDPSettings.from_dict(cfg.to_dict()) == cfg


def test_pp_is_the_outermost_axis_one_stage_per_node_group():
    layout = resolve_layout(_settings(), compute_topology_from_env(8, 2))
    assert layout.axis_names == ("pp", "dp_shard") and layout.shape == (2, 4)
    assert layout.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.groups("dp_shard") == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_stages_hold_hsdp_and_tp_inside():
    cfg = _settings(fsdp_sharding_strategy="hybrid_shard", tensor_parallel_size=2)
    layout = resolve_layout(cfg, compute_topology_from_env(16, 4))
    assert layout.axis_names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert layout.shape == (2, 2, 2, 2)
    # Stage 0 is nodes 0-1 (ranks 0-7), its shard groups one node each.
    assert layout.groups("pp")[0] == (0, 8)
    assert layout.groups("dp_shard")[0] == (0, 2)
    assert layout.groups("tp")[0] == (0, 1)


def test_expert_parallel_groups_stay_inside_a_stage():
    """ep 2 under pp 2 on 8 ranks: experts split over pairs of one stage's dp
    ranks, sharded over the other pair of the same stage; none crosses ``pp``."""
    layout = resolve_layout(_settings(expert_parallel_size=2), compute_topology_from_env(8, 2))
    assert layout.axis_names == ("pp", "dp_shard") and layout.shape == (2, 4)
    assert layout.expert_groups("ep") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.expert_groups("efsdp") == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_world_not_divisible_by_stages_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 must divide the world size 6"):
        cfg = FSDPSettings(use_fsdp=True, pipeline_parallel_size=4)
        resolve_layout(cfg, compute_topology_from_env(6, 3))


def test_unequal_stages_are_refused():
    with pytest.raises(ValueError, match="same layout"):
        resolve_layout(
            _settings(fsdp_sharding_strategy="hybrid_shard"), topology_from_node_counts([2, 2, 4])
        )


def test_balanced_split_counts_the_ends_as_layers_and_gives_the_extra_to_the_last_stages():
    """The embedding and the head weigh a layer each (torchtitan's rule) and
    the remainder goes to the last stages: 30 layers on 4 stages peak at 28
    layer-micro-batches under 1F1B (stage r keeps 4 - r in flight), where the
    old even split, remainder first (8, 8, 7, 7), peaked at 32."""
    assert balanced_split(30, 4) == [7, 8, 8, 7]
    assert max(n * (4 - r) for r, n in enumerate(balanced_split(30, 4))) == 28
    assert balanced_split(80, 4) == [19, 20, 21, 20]  # loads 20, 20, 21, 21
    assert balanced_split(7, 3) == [2, 3, 2] and balanced_split(3, 2) == [1, 2]
    assert balanced_split(5, 4) == [1, 1, 2, 1] and balanced_split(3, 3) == [1, 1, 1]
    plans = plan_stages(7, 3)
    assert [p.layers for p in plans] == [(0, 1), (2, 3, 4), (5, 6)]
    assert plans == plan_stages(7, 3, "auto")
    assert plans[0].first and plans[2].last and not plans[1].first and not plans[1].last
    assert [p.layers for p in plan_stages(4, 2, [1, 3])] == [(0,), (1, 2, 3)]


@pytest.mark.parametrize(
    "args, words",
    [((2, 3), "exceeds the model's 2 layers"), ((4, 2, [4, 0]), "at least one layer")],
)
def test_bad_splits_are_refused(args, words):
    with pytest.raises(ValueError, match=words):
        plan_stages(*args)


def test_microbatches_and_bubble():
    assert resolve_microbatches(None, 4) == 4
    assert resolve_microbatches(8, 4, rows=16) == 8
    with pytest.raises(ValueError, match="12 rows"):
        resolve_microbatches(8, 4, rows=12)
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)


def _decoder(tied=False) -> Transformer:
    cfg = ModelConfig(dim=16, n_layers=3, n_heads=2, seq_len=8, vocab_size=32, tie_embeddings=tied)
    with torch.device("meta"):
        return Transformer(cfg)


def test_split_keeps_the_original_names_on_meta():
    whole = {n for n, _ in _decoder().named_parameters()}
    first = {n for n, _ in split_for_stage(_decoder(), 0, 2).named_parameters()}
    last = {n for n, _ in split_for_stage(_decoder(), 1, 2).named_parameters()}
    assert first | last == whole and not first & last
    # balanced: stage 0 holds layer 0 and the embedding, stage 1 layers 1-2 and the head
    assert "tok_embeddings.weight" in first and "layers.0.ffn_norm.weight" in first
    assert "layers.1.attention.wq.weight" in last and "output.weight" in last
    assert "norm.weight" in last


def test_split_stage_forward_chains_to_the_whole_model():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, n_layers=3, n_heads=2, seq_len=8, vocab_size=32, tie_embeddings=False)
    whole = Transformer(cfg)
    ids = torch.randint(0, 32, (2, 8))
    expected = whole(ids)
    import copy

    first, last = (split_for_stage(copy.deepcopy(whole), s, 2) for s in range(2))
    torch.testing.assert_close(last(first(ids)), expected)


def test_tied_embeddings_are_refused_by_name():
    with pytest.raises(ValueError, match="tie_embeddings / tie_word_embeddings"):
        split_for_stage(_decoder(tied=True), 0, 2)


def test_unsupported_family_is_refused_by_name():
    with pytest.raises(ValueError, match="model_type"):
        split_for_stage(torch.nn.Linear(2, 2), 0, 2)


def test_plan_lines_name_stages_layers_and_bubble():
    from ray_fsdp_backend.planning.pipeline_layout import format_pipeline_plan

    lines = format_pipeline_plan(2, 6, "1f1b", 8, ((0, 2), (1, 3)))
    assert "0: layers 0-2 + embedding; 1: layers 3-5 + norm, head" in lines[0]
    split = format_pipeline_plan(2, 6, "1f1b", 8, ((0, 2), (1, 3)), split=[2, 4])[0]
    assert "0: layers 0-1 + embedding; 1: layers 2-5 + norm, head" in split
    assert "8 micro-batches: bubble 11.1%" in lines[0]
    assert lines[2:] == ["  [0, 2]", "  [1, 3]"]


def test_plan_counts_the_last_stages_whole_logits_under_pp():
    """Under pp the last stage's loss takes each pipeline micro-batch's whole
    logits (``loss_chunk_tokens`` does not apply): the plan's loss line says
    so, over a pipeline micro-batch's tokens (8 rows x 2 steps / 4 = 4 rows)."""
    from ray_fsdp_backend.cli.plan_report import format_loss_memory
    from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, load_yaml

    base = ["distributed.use_fsdp=true", "train.micro_batch_size=8", "train.grad_accum=2"]
    pp = [
        "distributed.pipeline_parallel_size=2",
        "distributed.pipeline_microbatches=4",
        "model.tie_embeddings=false",
        "scaling.num_workers=4",
    ]
    lines = {}
    for name, extra in (("pp1", []), ("pp2", pp)):
        doc = apply_overrides(load_yaml("examples/cpu_tiny.yaml"), [*base, *extra])
        lines[name] = format_loss_memory(build_spec(doc, torch_config=False), 1, 1, 8)
    seq = load_yaml("examples/cpu_tiny.yaml")["model"].get("seq_len", 128)
    assert f"{8 * seq:,} tokens" in lines["pp1"][0] and "chunked" in lines["pp1"][1]
    assert f"{4 * seq:,} tokens" in lines["pp2"][0] and len(lines["pp2"]) == 2
    assert "in use: the last pipeline stage's" in lines["pp2"][1]


PP_CASES = [
    ([], "ties its input and output embeddings"),  # the tiny preset ties them
    (["model.tie_embeddings=false", "train.micro_batch_size=3"], "micro_batch_size x"),
    (["model.tie_embeddings=false", "model.n_layers=1"], "exceeds the model's 1 layers"),
    (["model.tie_embeddings=false"], None),
    (["model.tie_embeddings=false", "distributed.pipeline_split=[1,3]"], None),
    # the sum needs the model: checked on the driver, naming the key and the layer count
    (
        ["model.tie_embeddings=false", "distributed.pipeline_split=[1,2]"],
        "distributed.pipeline_split=[1, 2] must give each of the 2 stages at least one layer "
        "and sum to the model's 4 layers",
    ),
    (
        ["model.tie_embeddings=false", "distributed.pipeline_split=[1,1,1]"],
        "pipeline_split=[1, 1, 1] has 3 entries; it needs one per pipeline stage",
    ),
]


@pytest.mark.parametrize(
    ("split", "words"),
    [
        ("even", "pipeline_split='even' is not 'auto' or a list of layer counts"),
        ([2, 0], "pipeline_split=[2, 0]: every stage's layer count must be an int >= 1"),
        ([2, True], "every stage's layer count must be an int >= 1"),
        (3, "pipeline_split=3 has type int; expected str or list"),
        ([1, 2, 3], "has 3 entries; it needs one per pipeline stage: pipeline_parallel_size=2"),
    ],
)
def test_pipeline_split_is_checked_statically(split, words):
    with pytest.raises(ValueError) as info:
        FSDPSettings(use_fsdp=True, pipeline_parallel_size=2, pipeline_split=split)
    assert words in str(info.value)


def test_pipeline_split_needs_stages_and_round_trips():
    with pytest.raises(ValueError, match=r"pipeline_split=\[2\] needs pipeline_parallel_size > 1"):
        FSDPSettings(pipeline_split=[2])
    cfg = FSDPSettings(use_fsdp=True, pipeline_parallel_size=2, pipeline_split=[1, 3])
    assert cfg.pipeline_split == (1, 3) and FSDPSettings().pipeline_split == "auto"
    assert FSDPSettings.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["pipeline_split"] == [1, 3]


@pytest.mark.parametrize(("overrides", "message"), PP_CASES)
def test_the_trainer_checks_pipeline_stages_before_ray_starts(overrides, message):
    """``ray-fsdp train`` at pp 2: what the split or the schedule would refuse
    on the workers is named on the driver (the split runs on a meta model)."""
    from ray_fsdp_backend.trainer.schema.spec import apply_overrides, check_spec, load_yaml

    doc = apply_overrides(
        load_yaml("examples/cpu_tiny.yaml"),
        ["distributed.pipeline_parallel_size=2", "scaling.num_workers=4", *overrides],
    )
    errors = [e for e in check_spec(doc) if "pipeline_parallel_size=2" in e]
    if message is None:
        assert errors == []
    else:
        assert len(errors) == 1 and message in errors[0], errors


def test_the_trainer_refuses_lora_under_pipeline_stages(tmp_path):
    from ray_fsdp_backend.trainer.schema.spec import apply_overrides, check_spec, load_yaml
    from tests.hf_models import save_tiny_pretrained

    path = save_tiny_pretrained("llama", tmp_path / "llama")
    doc = apply_overrides(
        load_yaml("examples/finetune_lora.yaml"),
        [
            f"model.pretrained={path}",
            "model.export=null",
            "distributed.pipeline_parallel_size=2",
            "scaling.num_workers=4",
        ],
    )
    errors = [e for e in check_spec(doc) if "pipeline_parallel_size=2" in e]
    assert len(errors) == 1 and "model.lora" in errors[0], errors


def test_the_loss_line_says_which_is_smaller_and_why():
    """Issue 55: at short micro-batches the chunked loss (one chunk of logits
    and an fp32 sum of the head's gradient) is above the full logits; the
    plan says so and from how many tokens chunking is smaller."""
    import re

    from ray_fsdp_backend.cli.plan_report import format_loss_memory
    from ray_fsdp_backend.planning.memory import estimate_loss_memory
    from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, load_yaml

    doc = apply_overrides(load_yaml("examples/cpu_tiny.yaml"), ["distributed.use_fsdp=true"])
    spec = build_spec(doc, torch_config=False)
    short = format_loss_memory(spec, 1, 1, 2)  # 2 rows x 128 tokens: inside one chunk
    assert "full logits are smaller at 256 tokens" in short[-1], short
    assert "fp32 sum of the head's gradient" in short[-1]
    start = int(re.search(r"from about ([\d,]+) tokens", short[-1]).group(1).replace(",", ""))
    model, kwargs = spec.model, dict(tp=1, value_bytes=4, loss_parallel=False)  # fp32

    def pays(t):
        chunked = estimate_loss_memory(t, model.vocab_size, model.dim, chunk=1024, **kwargs)
        return chunked < estimate_loss_memory(t, model.vocab_size, model.dim, chunk=0, **kwargs)

    assert pays(start) and not pays(start - 1) and start > 1024
    long = format_loss_memory(spec, 1, 1, 64)  # 8,192 tokens
    assert long[-1].startswith("  chunked is smaller: one 1,024-token chunk"), long
