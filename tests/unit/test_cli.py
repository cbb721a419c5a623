"""``ray-fsdp plan`` and ``validate``: pure, in-process, against the topology code."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from ray_fsdp_backend import FSDPConfig
from ray_fsdp_backend.cli.main import main
from ray_fsdp_backend.cli.plan_report import format_ranks
from ray_fsdp_backend.distributed.mesh import resolve_layout
from ray_fsdp_backend.planning.topology import compute_mesh_layout, compute_topology_from_env
from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, load_yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = sorted(EXAMPLES.glob("*.yaml"))
NAMES = [
    "cpu_tiny",
    "fsdp_1node_8gpu",
    "hsdp_multinode",
    "dmuon",
    "ddp",
    "elastic_spot",
    "finetune_hf",
    "long_context",
    "finetune_lora",
    "moe_ep",
    "finetune_qlora",
    "sft_chat",
    "pipeline_tiny",
    "dpo",
    "reward",
    "grpo",
]


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_issue_config_ships():
    assert sorted(p.stem for p in CONFIGS) == sorted(NAMES)


def test_validate_accepts_every_example(capsys, tmp_path):
    """Every example validates once the checkpoint its header makes exists
    (``model.pretrained`` is checked for a ``config.json``)."""
    pytest.importorskip("transformers")
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_chat_data, save_tiny_pretrained
    from ray_fsdp_backend.preference.make_pairs import make_pairs, write_pairs
    from ray_fsdp_backend.rl.example_task import main as write_prompts

    kinds = {  # basename: (kind, chat template)
        "rfb-tiny-llama": ("llama", False),
        "rfb-tiny-qwen3-moe": ("qwen3_moe", False),
        "rfb-tiny-llama-qlora": ("llama_qlora", False),
        "rfb-tiny-chat": ("llama", True),
    }
    chat = save_tiny_chat_data(tmp_path / "chat")
    configs = []
    for config in CONFIGS:
        doc = load_yaml(config)
        if "pretrained" in doc["model"]:
            # the kind its header makes: the static check reads its shapes
            name = os.path.basename(doc["model"]["pretrained"])
            kind, chat_template = kinds[name]
            path = save_tiny_pretrained(kind, tmp_path / name, chat=chat_template)
            doc["model"]["pretrained"] = path
        if doc.get("data", {}).get("format") == "chat":  # the records its header writes
            doc["data"] |= {"path": chat["train"], "eval_path": chat["eval"]}
        if doc.get("data", {}).get("format") == "preference":  # pairs, as its header writes
            doc["data"]["path"] = write_pairs(str(tmp_path / "pairs.jsonl"), make_pairs(64))
        if doc.get("data", {}).get("format") == "prompts":  # prompts, as its header writes
            write_prompts([str(tmp_path / "prompts.jsonl")])
            doc["data"]["path"] = str(tmp_path / "prompts.jsonl")
        if "pretrained" in doc["model"]:
            config = tmp_path / config.name
            config.write_text(yaml.safe_dump(doc))
        configs.append(str(config))
    rc, out, _ = run(capsys, "validate", *configs)
    assert rc == 0, out
    assert out.count(": OK") == len(CONFIGS)


# Each breakage: an override and a fragment the error must contain.
BREAKAGES = [
    ("distributed.fsdp_sharding_strategy=fullshard", "fsdp_sharding_strategy='fullshard'"),
    ("distributed.use_fdsp=true", "did you mean 'use_fsdp'"),
    ("distributed.timeout_s=-5", "timeout_s=-5"),
    ("model.n_heads=7", "model.n_heads=7"),
    ("train.steps=0", "steps=0"),
    ("train.optimizer=sgd", "optimizer='sgd'"),
    ("train.checkpoint_async=later", "checkpoint_async='later'"),
    ("scaling.use_gpu=sometimes", "use_gpu='sometimes'"),
    ("scaling.num_workers=0", "num_workers=0"),
    ("data.path=/no/such/file.txt", "is not a file"),
    ("trian.steps=3", "unknown section 'trian'"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("override, fragment", BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_validate_catches_each_broken_example(capsys, tmp_path, name, override, fragment):
    broken = tmp_path / f"{name}.yaml"
    broken.write_text(
        yaml.safe_dump(apply_overrides(load_yaml(EXAMPLES / f"{name}.yaml"), [override]))
    )
    rc, out, _ = run(capsys, "validate", str(broken))
    assert rc == 1
    assert fragment in out


def test_validate_reports_every_error_in_one_file(capsys, tmp_path):
    doc = load_yaml(EXAMPLES / "cpu_tiny.yaml")
    doc = apply_overrides(
        doc,
        [
            "distributed.bf16=maybe",
            "distributed.bogus=1",
            "model.dim=0",
            "train.lr=-1",
            "scaling.num_workers=0",
        ],
    )
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, out, _ = run(capsys, "validate", str(path))
    assert rc == 1
    for fragment in ("bf16='maybe'", "'bogus'", "model.dim=0", "lr=-1", "num_workers=0"):
        assert fragment in out
    assert "5 errors" in out


@pytest.mark.parametrize(
    "name",
    ["moe_ep", "sft_chat", "finetune_qlora", "finetune_hf", "finetune_lora", "pipeline_tiny"],
)
def test_validate_on_a_fresh_clone_names_the_command_that_makes_what_is_missing(
    capsys, tmp_path, name
):
    """The example as a fresh clone has it, its checkpoint not made yet (the
    path moved under ``tmp_path``): the error names the missing directory
    (under pipeline parallelism too, whose split reads the checkpoint) and
    comes with the header's command."""
    text = (EXAMPLES / f"{name}.yaml").read_text()
    text = text.replace("/tmp/rfb-tiny", f"{tmp_path}/rfb-tiny")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    rc, out, _ = run(capsys, "validate", str(path))
    assert rc == 1 and "its comments create what it reads first:" in out
    assert f"python -m ray_fsdp_backend.models.tiny_pretrained {tmp_path}/rfb-tiny" in out
    assert f"model.pretrained='{tmp_path}/rfb-tiny" in out and "directory not found" in out
    assert "Error:" not in out, out  # no library's exception in place of the key's error


def test_validate_reports_broken_yaml(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("distributed: [unclosed\n")
    rc, out, _ = run(capsys, "validate", str(path))
    assert rc == 1 and "1 error" in out


def test_muon_needs_dmuon_checked_beside_other_sections_errors(capsys):
    rc, out, _ = run(
        capsys,
        "validate",
        str(EXAMPLES / "dmuon.yaml"),
        "--set",
        "distributed.use_dmuon=false",
        "--set",
        "model.dim=0",
    )
    assert rc == 1 and "2 errors" in out
    assert "use_dmuon=False disagree" in out and "model.dim=0" in out


def parse_groups(out: str, axis: str) -> list[list[int]]:
    """The rank groups ``plan`` printed for one axis."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{axis} groups"))
    groups = []
    for line in lines[start + 1 :]:
        if not line.startswith("  ["):
            break
        body = line.strip()[1:-1]
        if "-" in body:
            lo, hi = map(int, body.split("-"))
            groups.append(list(range(lo, hi + 1)))
        else:
            groups.append([int(x) for x in body.split(",")])
    return groups


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_plan_hsdp_matches_the_topology_code(capsys, nodes):
    rc, out, _ = run(
        capsys,
        "plan",
        str(EXAMPLES / "hsdp_multinode.yaml"),
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        "8",
    )
    assert rc == 0
    cfg = FSDPConfig.from_yaml(EXAMPLES / "hsdp_multinode.yaml")
    layout = compute_mesh_layout(
        cfg.sharding_strategy, compute_topology_from_env(8 * nodes, 8), None
    )
    assert f"mesh:     (dp_replicate={nodes}, dp_shard=8)" in out
    assert layout.shape == (nodes, 8)
    assert parse_groups(out, "dp_shard") == [list(g) for g in layout.groups("dp_shard")]
    if nodes > 1:
        assert parse_groups(out, "dp_replicate") == [list(g) for g in layout.groups("dp_replicate")]
    else:
        assert "dp_replicate groups: 8 of one rank each" in out


@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.parametrize("name", ["fsdp_1node_8gpu", "ddp", "dmuon"])
def test_plan_one_axis_strategies_match_the_topology_code(capsys, name, nodes):
    rc, out, _ = run(
        capsys,
        "plan",
        str(EXAMPLES / f"{name}.yaml"),
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        "8",
    )
    assert rc == 0
    spec = build_spec(load_yaml(EXAMPLES / f"{name}.yaml"))
    layout = resolve_layout(spec.distributed, compute_topology_from_env(8 * nodes, 8))
    (axis,) = layout.axis_names
    assert f"mesh:     ({axis}={8 * nodes})" in out
    assert parse_groups(out, axis) == [list(g) for g in layout.groups(axis)]


def total_bytes(out: str) -> float:
    value, unit = re.search(r"total\s+([\d.]+) (\w+)", out).groups()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_plan_memory_shrinks_with_sharding(capsys):
    config = str(EXAMPLES / "fsdp_1node_8gpu.yaml")
    _, one_gpu, _ = run(capsys, "plan", config, "--nodes", "1", "--gpus-per-node", "1")
    _, eight, _ = run(capsys, "plan", config, "--nodes", "1", "--gpus-per-node", "8")
    _, ddp, _ = run(
        capsys,
        "plan",
        config,
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--set",
        "distributed.use_fsdp=false",
    )
    assert "parameters" in eight and "optimizer" in eight and "model state only" in eight
    assert total_bytes(eight) < total_bytes(one_gpu) / 4
    assert total_bytes(ddp) > 5 * total_bytes(eight)


def test_plan_refuses_impossible_layouts_with_the_backend_error(capsys):
    config = str(EXAMPLES / "hsdp_multinode.yaml")
    rc, _, err = run(
        capsys,
        "plan",
        config,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--set",
        "distributed.fsdp_hsdp_replicate_size=3",
    )
    assert rc == 2
    cfg = FSDPConfig.from_dict({**load_yaml(config)["distributed"], "fsdp_hsdp_replicate_size": 3})
    with pytest.raises(ValueError) as expected:
        resolve_layout(cfg, compute_topology_from_env(16, 8))
    assert err.strip() == f"error: {expected.value}"


def test_plan_refuses_an_invalid_config(capsys):
    rc, _, err = run(
        capsys,
        "plan",
        str(EXAMPLES / "cpu_tiny.yaml"),
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--set",
        "distributed.fsdp_sharding_strategy=zero3",
    )
    assert rc == 2 and "fsdp_sharding_strategy='zero3'" in err


@pytest.mark.parametrize("bad", ["steps=3", "train.=3", "train.steps"])
def test_set_needs_a_dotted_key_and_a_value(capsys, bad):
    rc, out, _ = run(capsys, "validate", str(EXAMPLES / "cpu_tiny.yaml"), "--set", bad)
    assert rc == 1
    assert "expected section.key=value" in out


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3]) == "[0-3]"
    assert format_ranks([0, 8, 16]) == "[0, 8, 16]"
    assert format_ranks([5]) == "[5]"


def test_plan_pretrained_with_dmuon(capsys, tmp_path):
    pytest.importorskip("transformers")
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    path = save_tiny_pretrained("llama", tmp_path / "tiny")
    config = str(EXAMPLES / "finetune_hf.yaml")
    sets = [f"model.pretrained={path}", "distributed.use_dmuon=true", "train.optimizer=muon"]
    args = [a for s in sets for a in ("--set", s)]
    code, out, err = run(capsys, "plan", config, "--nodes", "1", "--gpus-per-node", "2", *args)
    assert code == 0, err
    assert "Newton–Schulz on 14 matrices" in out  # 2 blocks x 7 matrices of the tiny Llama
