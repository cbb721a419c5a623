"""``ray-fsdp``: train the example model, plan a layout, validate a config.

    ray-fsdp train examples/cpu_tiny.yaml [--set train.steps=20 ...]
    ray-fsdp plan examples/hsdp_multinode.yaml --nodes 4 --gpus-per-node 8
    ray-fsdp validate examples/*.yaml

``train`` joins the Ray cluster at ``RAY_ADDRESS`` (set inside a Ray job) or,
without it, starts a local one; it uses GPUs when the cluster has them
(``scaling.use_gpu: auto``). ``plan`` and ``validate`` start nothing: ``plan``
runs the backend's own topology and mesh functions, so it accepts and refuses
exactly the layouts the backend does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence

from ray_fsdp_backend.elastic import worker_range
from ray_fsdp_backend.expert_plan import moe_model_from_hf
from ray_fsdp_backend.plan_report import format_elastic_plan, format_plan, model_config_from_hf
from ray_fsdp_backend.trainer.pretrained import PretrainedModelConfig
from ray_fsdp_backend.trainer.spec import (
    RunSpec,
    apply_overrides,
    build_spec,
    check_spec,
    load_yaml,
)

EXIT_INVALID = 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-fsdp", description="FSDP2 / HSDP / DDP / DMuon training on Ray."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train the example model described by CONFIG")
    train.add_argument("config", help="training YAML, e.g. examples/cpu_tiny.yaml")
    train.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show everything: Ray Train's per-report lines, Ray Data's progress bars, "
        "library warnings (logging.verbose=true)",
    )
    _add_set(train)
    train.set_defaults(handler=cmd_train)

    plan = commands.add_parser("plan", help="mesh, rank groups and memory, without starting")
    plan.add_argument("config")
    plan.add_argument("--nodes", type=int, required=True, help="number of nodes")
    plan.add_argument("--gpus-per-node", type=int, required=True, help="workers per node")
    plan.add_argument(
        "--hf-config",
        help="a transformers config.json (Llama family, or a Qwen3-MoE / Mixtral / DeepSeek-V3 "
        "mixture of experts: dense vs expert memory and expert traffic): plan that model instead",
    )
    _add_set(plan)
    plan.set_defaults(handler=cmd_plan)

    validate = commands.add_parser("validate", help="check configs and report every error")
    validate.add_argument("configs", nargs="+", metavar="config")
    _add_set(validate)
    validate.set_defaults(handler=cmd_validate)
    return parser


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value by dotted key, e.g. --set train.steps=20 (repeatable)",
    )


def load(path: str, overrides: Sequence[str]) -> RunSpec:
    return build_spec(apply_overrides(load_yaml(path), overrides))


# -- validate -----------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    """Print ``OK`` or every error for each config; exit 1 if any is invalid."""
    failed = 0
    for path in args.configs:
        try:
            errors = check_spec(apply_overrides(load_yaml(path), args.overrides))
        except Exception as exc:  # unreadable file or broken YAML: one error for this file
            errors = [f"{type(exc).__name__}: {exc}"]
        if errors:
            failed += 1
            print(f"{path}: {len(errors)} error{'s' if len(errors) > 1 else ''}")
            for error in errors:
                print(f"  - {error}")
        else:
            print(f"{path}: OK")
    return 1 if failed else 0


# -- plan ---------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    spec = load(args.config, args.overrides)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be at least 1")
    moe = None
    if args.hf_config:
        spec = dataclasses.replace(spec, model=model_config_from_hf(args.hf_config, spec))
        with open(args.hf_config) as f:
            moe = moe_model_from_hf(json.load(f))
    print(format_plan(spec, args.nodes, args.gpus_per_node, moe))
    low, high = worker_range(spec.scaling.num_workers)
    if low != high:
        print(format_elastic_plan(spec, args.gpus_per_node, moe))
    return 0


# -- train --------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, *(["logging.verbose=true"] if args.verbose else [])]
    spec = build_spec(absolute_tensorboard_dir(apply_overrides(load_yaml(args.config), overrides)))
    name = spec.run.name or f"{_stem(args.config)}-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_training(spec, name)
    history = result.return_value or []
    outputs = write_outputs(result, history)
    if history:
        first, last = history[0], history[-1]
        print(
            f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
            f"(step {last['step']})"
        )
    print(f"results:    {result.path}")
    for label, path in outputs.items():
        print(f"{label + ':':<11} {path}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint.path}")
    if isinstance(spec.model, PretrainedModelConfig) and spec.model.export:
        print(f"export:     {spec.model.export} ({spec.model.export_format} layout)")
    if spec.logging.tensorboard:
        print(f"tensorboard: tensorboard --logdir {spec.logging.tensorboard}")
    return 0


def absolute_tensorboard_dir(doc: dict) -> dict:
    """``logging.tensorboard`` relative to where the command runs, not to the
    workers' working directory."""
    section = doc.get("logging")
    path = section.get("tensorboard") if isinstance(section, dict) else None
    if isinstance(path, str) and "://" not in path:
        section["tensorboard"] = os.path.abspath(os.path.expanduser(path))
    return doc


def run_training(spec: RunSpec, name: str):
    """Fit the example model with a ``TorchTrainer``; returns the Ray ``Result``."""
    import ray
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    from ray_fsdp_backend.trainer.train import train_loop_per_worker

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            # address="local" starts a fresh cluster: never join a stale one by
            # accident. Give it a CPU beyond the workers' (logical) so Ray Data
            # tasks can run beside them on a 2-core machine instead of waiting.
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, _worker_cpus(spec) + 1))
    use_gpu = resolve_use_gpu(spec.scaling.use_gpu, ray.cluster_resources())
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=spec.raw,
        torch_config=spec.distributed,
        scaling_config=scaling_config(spec, use_gpu),
        run_config=RunConfig(
            name=name,
            storage_path=spec.run.storage_path,
            failure_config=FailureConfig(max_failures=spec.run.max_failures),
        ),
        datasets=build_datasets(spec),
        dataset_config=dataset_config(spec),
    )
    return trainer.fit()


def scaling_config(spec: RunSpec, use_gpu: bool):
    """Ray's ``ScalingConfig``; ``num_workers: [min, max]`` makes it elastic."""
    from ray.train import ScalingConfig

    low, high = worker_range(spec.scaling.num_workers)
    elastic = {"elastic_resize_monitor_interval_s": spec.scaling.elastic_resize_monitor_interval_s}
    return ScalingConfig(
        num_workers=low if low == high else (low, high),
        use_gpu=use_gpu,
        resources_per_worker=spec.scaling.resources_per_worker,
        placement_strategy=spec.scaling.placement_strategy,
        **(elastic if low != high else {}),
    )


def _worker_cpus(spec: RunSpec) -> int:
    per_worker = (spec.scaling.resources_per_worker or {}).get("CPU", 1)
    return int(math.ceil(per_worker * worker_range(spec.scaling.num_workers)[1]))


def resolve_use_gpu(setting: bool | str, cluster_resources: dict) -> bool:
    """``auto``: GPUs when the cluster has any."""
    if setting == "auto":
        return cluster_resources.get("GPU", 0) > 0
    return bool(setting)


def dataset_config(spec: RunSpec):
    """Training rows split by dp rank, not world rank (``rfb.MeshDataConfig``);
    the held-out set whole to every rank. ``chat`` / ``prompt_completion``
    rows keep their seeded order through the split (``preserve_order``), so a
    resume at the same worker count skips exactly the rows already read."""
    from ray.train import DataConfig

    from ray_fsdp_backend.data_config import MeshDataConfig

    options = None
    if spec.data.is_sft:
        options = DataConfig.default_ingest_options()
        options.preserve_order = True
        options = {"train": options}
    return MeshDataConfig(datasets_to_split=["train"], execution_options=options)


def build_datasets(spec: RunSpec) -> dict | None:
    """The run's Ray datasets, built on the driver: ``rfb.sft_dataset`` rows
    for ``chat`` / ``prompt_completion`` (``train`` and the held-out ``eval``),
    byte rows for the text ``ray_data`` source; None for the text corpus."""
    if not spec.data.is_sft and spec.data.source != "ray_data":
        return None
    import ray.data

    # Ray Data draws a progress bar per operator, thousands of lines around a
    # short run's progress lines: off unless asked for (-v).
    ray.data.DataContext.get_current().enable_progress_bars = spec.logging.verbose
    if spec.data.is_sft:
        from ray_fsdp_backend.trainer.sft_data import build_sft_datasets

        return build_sft_datasets(spec)
    from ray_fsdp_backend.trainer.data import pack_text_rows

    rows = ray.data.read_text(spec.data.path).map_batches(
        pack_text_rows, fn_kwargs={"seq_len": spec.model.seq_len}, batch_size=1024
    )
    return {"train": rows}


def write_outputs(result, history: list[dict]) -> dict[str, str]:
    """``metrics.jsonl`` and ``loss_curve.png`` in the run directory (any
    storage Ray supports: its ``pyarrow`` filesystem writes them). A resumed
    run extends the history of the run it resumed."""
    if not history:
        return {}
    fs, root = result.filesystem, result.path
    metrics_path = f"{root}/metrics.jsonl"
    history = merge_history(read_history(fs, metrics_path), history)
    with fs.open_output_stream(metrics_path) as f:
        f.write("".join(json.dumps(m) + "\n" for m in history).encode())
    outputs = {"metrics": metrics_path}
    try:
        png = render_loss_curve(history)
    except ImportError:
        print("matplotlib is not installed: no loss curve (pip install 'ray_fsdp_backend[plot]')")
        return outputs
    plot_path = f"{root}/loss_curve.png"
    with fs.open_output_stream(plot_path) as f:
        f.write(png)
    return {**outputs, "loss curve": plot_path}


def read_history(fs, path: str) -> list[dict]:
    import pyarrow.fs

    if fs.get_file_info(path).type == pyarrow.fs.FileType.NotFound:
        return []
    with fs.open_input_stream(path) as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]


def merge_history(old: list[dict], new: list[dict]) -> list[dict]:
    """The earlier run's entries before the resumed run's first step, then the new ones."""
    first = new[0]["step"]
    return [m for m in old if m["step"] < first] + new


def render_loss_curve(history: list[dict]) -> bytes:
    """PNG bytes of loss against step (matplotlib, headless Agg backend)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot([m["step"] for m in history], [m["loss"] for m in history], marker=".")
    ax.set(xlabel="step", ylabel="loss (nats / byte)", title="training loss")
    ax.grid(True, alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


if __name__ == "__main__":
    sys.exit(main())
