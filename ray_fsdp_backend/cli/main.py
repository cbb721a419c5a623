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

from ray_fsdp_backend.cli.hints import setup_commands
from ray_fsdp_backend.cli.plan_report import format_elastic_plan, format_plan, model_config_from_hf
from ray_fsdp_backend.compat.optional_imports import keep_torchao_unimported
from ray_fsdp_backend.planning.elastic import worker_range
from ray_fsdp_backend.planning.experts import moe_model_from_hf
from ray_fsdp_backend.runtime.ray_start import init_ray
from ray_fsdp_backend.trainer.schema.preflight import cluster_errors
from ray_fsdp_backend.trainer.schema.pretrained import PretrainedModelConfig
from ray_fsdp_backend.trainer.schema.spec import (
    RunSpec,
    apply_overrides,
    build_spec,
    check_spec_report,
    load_yaml,
)

EXIT_INVALID = 2
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # this process is the command: the driver never quantises (workers may)
        keep_torchao_unimported()
    try:
        return args.handler(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print(
            "interrupted: the run and the local Ray cluster it started are stopped", file=sys.stderr
        )
        return EXIT_INTERRUPTED


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
    """The spec ``plan`` reads: its ``distributed`` the plain settings, so
    that nothing here imports Ray or (for the example decoder) torch."""
    return build_spec(apply_overrides(load_yaml(path), overrides), torch_config=False)


# -- validate -----------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    """Print ``OK`` (and an SFT config's record counts) or every error for
    each config; exit 1 if any is invalid."""
    failed = 0
    for path in args.configs:
        counted = []
        try:
            errors, counted = check_spec_report(apply_overrides(load_yaml(path), args.overrides))
        except Exception as exc:  # unreadable file or broken YAML: one error for this file
            errors = [f"{type(exc).__name__}: {exc}"]
        if errors:
            failed += 1
            print(f"{path}: {len(errors)} error{'s' if len(errors) > 1 else ''}")
            for error in errors:
                print(f"  - {error}")
            commands = setup_commands(path)
            if commands:
                print("  its comments create what it reads first:")
                for command in commands:
                    print(f"    {command}")
        else:
            print(f"{path}: OK")
            for line in counted:
                print(f"  {line}")
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
    errors = plan_layout_errors(spec, [args.gpus_per_node] * args.nodes, moe)
    if errors:
        raise ValueError("invalid layout for this model:\n  " + "\n  ".join(errors))
    print(format_plan(spec, args.nodes, args.gpus_per_node, moe))
    low, high = worker_range(spec.scaling.num_workers)
    if low != high:
        print(format_elastic_plan(spec, args.gpus_per_node, moe))
    return 0


def plan_layout_errors(spec: RunSpec, node_counts: list[int], moe) -> list[str]:
    """The static check's model rules again on ``plan``'s own nodes, and an
    ``--hf-config`` MoE's expert count against ``expert_parallel_size``."""
    ep = spec.distributed.expert_parallel_size
    if moe is not None and moe.experts.num_experts % ep:
        return [
            f"distributed.expert_parallel_size={ep} does not divide the "
            f"{moe.experts.num_experts} experts of every MoE layer (--hf-config): "
            f"every ep rank holds the same number of experts"
        ]
    if not isinstance(spec.model, PretrainedModelConfig):
        return []
    from ray_fsdp_backend.hf.layout_check import pretrained_layout_errors

    return pretrained_layout_errors(spec.model, spec.distributed, [list(node_counts)])


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
    """Fit the example model with a ``TorchTrainer``; returns the Ray ``Result``.

    Before the trainer is built, the workers' resources are checked against
    the cluster's (:func:`~ray_fsdp_backend.trainer.schema.preflight.cluster_errors`):
    a local cluster is refused with the keys to change, a joined one (whose
    autoscaler may add nodes) is warned about. Either way the job's workers
    know which cluster is theirs (:mod:`~ray_fsdp_backend.runtime.ray_start`: Ray
    Train's placement-group cleaner would search the host for one). Ctrl-C
    stops the run and the local cluster this started."""
    local = not os.environ.get("RAY_ADDRESS")
    quiet_driver_console(local=local)
    if local and not spec.logging.verbose:
        from ray_fsdp_backend.metrics.reporting import quiet_ray_data_console

        quiet_ray_data_console()  # before the cluster starts: its processes inherit it
    import ray

    started = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            init_ray(None)
        else:
            # address="local" starts a fresh cluster: never join a stale one by
            # accident. Give it a CPU beyond the workers' (logical) so Ray Data
            # tasks can run beside them on a 2-core machine instead of waiting.
            init_ray("local", num_cpus=max(os.cpu_count() or 1, _worker_cpus(spec) + 1))
    try:
        return in_thread(_fit, spec, name, ray.cluster_resources(), refuse=started)
    finally:
        if started:  # on Ctrl-C too: the local cluster's processes go with it
            ray.shutdown()


def in_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a daemon thread, its result or exception
    returned or raised here. Ctrl-C reaches this (main) thread at once:
    ``TrainController`` installs no SIGINT handler off the main thread, whose
    "graceful abort" (Ray 2.60) waits on a controller that may itself be
    waiting for a worker group to start."""
    import threading

    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="ray-fsdp-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _fit(spec: RunSpec, name: str, resources: dict, *, refuse: bool):
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    from ray_fsdp_backend.trainer.loop.train import train_loop_per_worker

    errors = cluster_errors(spec.scaling, resources)
    if errors and refuse:
        raise ValueError("the cluster cannot hold these workers:\n  " + "\n  ".join(errors))
    for error in errors:
        print(f"warning: {error} (waiting for the autoscaler)", file=sys.stderr)
    use_gpu = resolve_use_gpu(spec.scaling.use_gpu, resources)
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


def quiet_driver_console(*, local: bool) -> None:
    """Ray 2.60's switches for what the driver prints, set before Ray is
    imported (they are read then) and only where the user set none: worker
    lines without the ``(RayTrainWorker pid=...)`` prefix; on a local cluster
    (no cloud to preempt it) no PreemptionWatcher, whose polling logs a
    core_worker error line per run; on a joined cluster it stays on."""
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # Ray imported already (by the spec): it read the variable then
        constants.RAY_DISABLE_WORKER_LOG_PREFIX = os.environ["RAY_DISABLE_WORKER_LOG_PREFIX"] in (
            "1",
            "true",
            "True",
        )
    if local:
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


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
    from ray_fsdp_backend.runtime.data_config import MeshDataConfig
    from ray_fsdp_backend.trainer.data.sft import EVAL_DATASET

    train = ingest_options(preserve_order=spec.data.is_sft)
    options = {"train": train, EVAL_DATASET: ingest_options()}
    return MeshDataConfig(datasets_to_split=["train"], execution_options=options)


def ingest_options(*, preserve_order: bool = False):
    """Ray Train's ``DataConfig.default_ingest_options()`` (Ray 2.60) without
    ``exclude_resources``, which it copies from the context and whose setter
    warns that it is deprecated (a ``RayDeprecationWarning`` on the driver's
    console, and the controller's for every dataset given no options).
    ``preserve_order`` as the context's, or on."""
    from ray.data import DataContext, ExecutionOptions

    current = DataContext.get_current().execution_options
    return ExecutionOptions(
        resource_limits=current.resource_limits,
        preserve_order=preserve_order or current.preserve_order,
        verbose_progress=current.verbose_progress,
    )


def build_datasets(spec: RunSpec) -> dict | None:
    """The run's Ray datasets, built on the driver: ``rfb.sft_dataset`` rows
    for ``chat`` / ``prompt_completion`` (``train`` and the held-out ``eval``),
    byte rows for the text ``ray_data`` source; None for the text corpus."""
    if not spec.data.is_sft and spec.data.source != "ray_data":
        return None
    import ray.data

    # Ray Data draws a progress bar per operator, thousands of lines around a
    # short run's progress lines, and (Ray 2.60) prints a "Starting execution"
    # and an "Execution plan" line each time a dataset runs: every epoch of
    # the training split. Off unless asked for (-v).
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = spec.logging.verbose
    context.print_on_execution_start = spec.logging.verbose
    if spec.data.is_sft:
        from ray_fsdp_backend.trainer.data.sft import build_sft_datasets

        return build_sft_datasets(spec)
    from ray_fsdp_backend.trainer.data.corpus import pack_text_rows

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
