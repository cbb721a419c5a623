"""What Ray's reporting costs a fast model: ``python -m benchmarks.reporting``.

Runs the trainer's real loop (``ray-fsdp train``'s ``train_loop_per_worker``)
on the example decoder with 2 CPU workers, side by side (alternating, ``reps``
times, medians):

- ``log_every: 1000``: the first and last steps logged;
- ``log_every: 1``: every step logged to the trainer's sinks (no Ray report);
- ``log_every: 1`` with ``ray.train.report`` at every logged step (what the
  trainer did before reporting left the training path).

Step time is rank 0's wall time from the end of step 1 to the last step,
over the steps between. The issue's bar: ``log_every: 1`` within 5% of
``log_every: 1000``. Needs a local Ray (started here, ``ray.init``).

    python -m benchmarks.reporting [--steps 60] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu_tiny.yaml"
VARIANTS = {
    "log_every_1000": (1000, False),
    "log_every_1": (1, False),
    "log_every_1_ray_report": (1, True),
}


def _loop(loop_config: dict) -> list[dict]:
    """The trainer's loop; with ``ray_report`` Ray gets every logged step too."""
    import ray.train

    import ray_fsdp_backend as rfb
    from ray_fsdp_backend.trainer.loop.train import run_training
    from ray_fsdp_backend.trainer.schema.spec import build_spec

    ray_report = loop_config.pop("ray_report")
    spec = build_spec(loop_config)
    report = ray.train.report if ray_report else (lambda metrics: None)
    return run_training(rfb.get_context(), spec, report=report, resume=False)


def _ms_per_step(steps: int, log_every: int, ray_report: bool, storage: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, load_yaml

    sets = [f"train.steps={steps}", f"train.log_every={log_every}"]
    sets += ["train.micro_batch_size=2", "model.seq_len=32", "train.warmup_steps=2"]
    spec = build_spec(apply_overrides(load_yaml(EXAMPLE), sets))
    history = (
        TorchTrainer(
            _loop,
            train_loop_config={**spec.raw, "ray_report": ray_report},
            torch_config=spec.distributed,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=storage),
        )
        .fit()
        .return_value
    )
    first, last = history[0], history[-1]
    return 1000 * (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])


def run(*, steps: int = 60, reps: int = 2) -> dict:
    import ray

    from ray_fsdp_backend.runtime.ray_start import init_ray

    init_ray("local", num_cpus=3, log_to_driver=False)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        with tempfile.TemporaryDirectory() as storage:
            for _ in range(reps):
                for name, (log_every, ray_report) in VARIANTS.items():
                    times[name].append(_ms_per_step(steps, log_every, ray_report, storage))
    finally:
        ray.shutdown()
    out = {name: statistics.median(t) for name, t in times.items()}
    out["ratio_log_1_vs_1000"] = out["log_every_1"] / out["log_every_1000"]
    out["ratio_ray_report_vs_1000"] = out["log_every_1_ray_report"] / out["log_every_1000"]
    return {"ms_per_step": out, "runs": times, "steps": steps, "reps": reps}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(run(steps=args.steps, reps=args.reps), indent=1))


if __name__ == "__main__":
    main()
