"""One command for every comparison: ``python -m benchmarks.run``.

Runs, side by side in one run (A and B alternating, several repetitions,
medians and the median ratio):

1. step time, ours vs hand-written ``fully_shard`` (``step_time``);
2. memory per rank vs the ideal total/N and DDP (``step_time``);
3. clipping time and collectives vs ``torch.nn.utils.clip_grad_norm_`` (``clipping``);
4. start-up, ``FSDPConfig`` vs Ray's ``TorchConfig`` + hand-written FSDP2 (``startup``);
5. the DMuon optimizer step vs ``torch.optim.Muon`` (``dmuon_bench``);
6. step time and memory as width and depth double (``scaling``);
7. step time with ``compile: true`` vs eager (``compile_bench``);
8. loading a pretrained HF checkpoint: ours sharded vs ``from_pretrained``
   on every rank, peak host memory and time (``pretrained``);
9. checkpoint save/restore on local disk and S3 (moto), bytes read per
   restore, training stall per checkpoint sync vs async (``checkpoint_io``);
10. LoRA r 8 and r 64 vs full fine-tuning: memory, step time and checkpoint
    bytes per rank (``lora``);
11. tensor parallel tp 2 x dp 2 vs FSDP2 dp 4 on the same global batch:
    step time and memory per rank; TP step time and bytes per step before /
    after one reduction per attention and MLP (``tensor_parallel``);
12. a Hugging Face checkpoint on S3 with 30 ms per request: load time and
    bytes before and after concurrent ranged reads, export time and bytes
    per rank (``hf_s3``);

and writes ``results.json`` and ``results.md`` into ``--out``
(default ``benchmarks/results``). ``--quick`` uses the smallest sizes and
runs every job of 2 ranks on one spawned group (the test suite's smoke run,
:data:`POOL_WORLD`);
``--only`` picks comparisons by name. ``results.json`` records each
comparison's seconds (``seconds``).

    python -m benchmarks.run                       # everything, ~4 min on 2 cores
    python -m benchmarks.run --quick --out /tmp/b  # smallest sizes, ~1.5 min on 2 busy cores
    python -m benchmarks.run --update-docs       # and put the tables into docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import (
    _measure,
    checkpoint_io,
    clipping,
    compile_bench,
    dmuon_bench,
    hf_s3,
    lora_bench,
    pretrained,
    report,
    scaling,
    startup,
    step_time,
    tensor_parallel_bench,
)
from benchmarks._pool import RankPool
from tests.dist.harness import run_ranks

COMPARISONS = (
    "step_time",
    "clipping",
    "startup",
    "dmuon",
    "scaling",
    "compile",
    "pretrained",
    "checkpoint_io",
    "lora",
    "tensor_parallel",
    "hf_s3",
)

TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=2, seq_len=32)
SMALL = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, seq_len=64)

ONE_STEP = dict(batch=4, accum=1, reps=5, steps=2)
QUICK_STEP = dict(batch=2, accum=1, reps=2, steps=1)

SETTINGS = {
    "full": {
        "step_time": dict(worlds=(2, 4), model=SMALL, batch=4, accum=2, reps=11, steps=3),
        "clipping": dict(worlds=(2, 4), counts=clipping.TENSOR_COUNTS, reps=7, steps=3),
        "startup": dict(model=SMALL, batch=4, workers=2, reps=4, warmup=True),
        "dmuon": dict(sizes=(64, 128, 256, 512), ranks=(1, 2, 4), steps=3),
        "scaling": dict(world=2, base=SMALL, widths=(64, 128, 256), layers=(2, 4, 8), **ONE_STEP),
        "compile": dict(world=2, model=SMALL, batch=4, accum=1, reps=7, steps=3),
        "pretrained": dict(worlds=(1, 2, 4), dim=512, layers=8, vocab=32000, reps=2),
        "checkpoint_io": dict(worlds=(2, 4, 8), model=SMALL, reps=2, steps=10),
        "lora": dict(worlds=(2, 4), dim=512, layers=8, vocab=32000, steps=3, batch=2, seq=128),
        "tensor_parallel": dict(world=4, model=SMALL, batch=8, reps=7, steps=3),
        "hf_s3": dict(
            worlds=(2, 4), dim=128, layers=16, vocab=2000, latency_s=0.03, baseline="25cc52e"
        ),
    },
    "quick": {
        "step_time": dict(worlds=(2,), model=TINY, batch=2, accum=2, reps=2, steps=1),
        "clipping": dict(worlds=(2,), counts=(10, 100), reps=2, steps=1),
        "startup": dict(model=TINY, batch=2, workers=2, reps=1, warmup=False),
        "dmuon": dict(sizes=(32,), ranks=(2,), steps=2),  # the sharded path; 1 is the reference
        "scaling": dict(world=2, base=TINY, widths=(32, 64), layers=(1, 2), **QUICK_STEP),
        "compile": dict(world=2, model=TINY, batch=2, accum=1, reps=2, steps=1),
        # One spawn per world size for all sides (_measure.run_sides): peaks not isolated.
        "pretrained": dict(worlds=(2,), dim=64, layers=2, vocab=512, reps=1, one_spawn=True),
        "checkpoint_io": dict(worlds=(2,), model=TINY, reps=1, steps=2),
        # dim 256: every shard of every linear weight a multiple of NF4's 64 x 256 (QLoRA)
        "lora": dict(
            worlds=(2,), dim=256, layers=2, vocab=512, steps=1, batch=2, seq=16, one_spawn=True
        ),
        "tensor_parallel": dict(world=4, model=TINY, batch=4, reps=2, steps=1),
        "hf_s3": dict(worlds=(2,), dim=64, layers=2, vocab=512, latency_s=0.03, baseline=None),
    },
}


# Ranks unpickle this by name: from a light module, not from this one (which
# imports every comparison, Ray Train and pyarrow into each spawned rank).
_on_rank = _measure.one_thread


def run_step_time(worlds, model, batch, accum, reps, steps, run_ranks=run_ranks) -> list[dict]:
    kwargs = dict(model=model, batch=batch, accum=accum, reps=reps, steps=steps)
    return [run_ranks(_on_rank, w, step_time.on_rank, kwargs) for w in worlds]


def run_clipping(worlds, counts, reps, steps, run_ranks=run_ranks) -> list[dict]:
    kwargs = dict(counts=tuple(counts), reps=reps, steps=steps)
    return [run_ranks(_on_rank, w, clipping.on_rank, kwargs) for w in worlds]


def run_startup(run_ranks=None, **kwargs) -> dict:
    """On the cluster this process is connected to (the test suite's shared
    one, left running), else on a local cluster started and shut down here."""
    import ray

    from ray_fsdp_backend.runtime.ray_start import init_ray

    started = not ray.is_initialized()
    if started:
        # Train V2's placement-group cleaner asks this cluster's State API: the
        # dashboard stays on to answer it (see ray_fsdp_backend/runtime/ray_start.py).
        init_ray("local", num_cpus=kwargs["workers"] + 1, include_dashboard=True,
                 log_to_driver=False)  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as storage:
            return startup.run(**kwargs, storage=storage)
    finally:
        if started:
            ray.shutdown()


def run_dmuon(sizes, ranks, steps, run_ranks=run_ranks) -> dict:
    return dmuon_bench.run(sizes=tuple(sizes), ranks=tuple(ranks), steps=steps,
                           run_ranks=run_ranks)  # fmt: skip


def run_scaling(world, run_ranks=run_ranks, **kwargs) -> dict:
    return run_ranks(_on_rank, world, scaling.on_rank, kwargs)


def run_compile(world, run_ranks=run_ranks, **kwargs) -> dict:
    return run_ranks(_on_rank, world, compile_bench.on_rank, kwargs)


def run_pretrained(run_ranks=run_ranks, **kwargs) -> dict:
    return pretrained.run(run_ranks, **kwargs)


def run_lora(run_ranks=run_ranks, **kwargs) -> dict:
    return lora_bench.run(run_ranks, **kwargs)


def run_tensor_parallel(world, run_ranks=run_ranks, **kwargs) -> dict:
    return run_ranks(_on_rank, world, tensor_parallel_bench.on_rank, kwargs)


RUNNERS = {
    "step_time": run_step_time,
    "clipping": run_clipping,
    "startup": run_startup,
    "dmuon": run_dmuon,
    "scaling": run_scaling,
    "compile": run_compile,
    "pretrained": run_pretrained,
    "checkpoint_io": checkpoint_io.run,
    "lora": run_lora,
    "tensor_parallel": run_tensor_parallel,
    "hf_s3": hf_s3.run,
}
"""Each takes its settings and ``run_ranks`` (the gloo harness's, or a
:class:`~benchmarks._pool.RankPool`'s)."""

POOL_WORLD = 2
"""``--quick`` runs every job of 2 ranks on one :class:`~benchmarks._pool.RankPool`:
a job's start (spawning the ranks, importing torch and transformers, a
process group) costs more than each comparison does at its smallest sizes."""


def machine() -> dict:
    """What the numbers were measured on."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import ray

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "backend": "gloo/cpu",
        "commit": commit,
    }


def run(mode: str = "full", only: tuple[str, ...] = COMPARISONS) -> dict:
    """Every selected comparison's results, as one JSON-ready dict."""
    settings = {name: SETTINGS[mode][name] for name in only}
    results = {"mode": mode, "machine": machine(), "settings": settings, "seconds": {}}
    with contextlib.ExitStack() as stack:
        ranks = run_ranks
        if mode == "quick":
            ranks = stack.enter_context(RankPool(POOL_WORLD)).run_ranks
        for name in only:
            start = time.perf_counter()
            results[name] = RUNNERS[name](**settings[name], run_ranks=ranks)
            results["seconds"][name] = round(time.perf_counter() - start, 1)
    return results


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--only", nargs="+", choices=COMPARISONS, default=list(COMPARISONS), metavar="NAME",
        help=f"comparisons to run, of: {', '.join(COMPARISONS)}",
    )  # fmt: skip
    parser.add_argument(
        "--update-docs", action="store_true", help="put the tables into docs/benchmarks.md"
    )
    args = parser.parse_args(argv)
    results = run("quick" if args.quick else "full", tuple(args.only))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = report.markdown(results)
    (args.out / "results.md").write_text(table)
    if args.update_docs:
        report.update_docs(Path(__file__).parent.parent / "docs" / "benchmarks.md", table)
    print(table)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    return args.out


if __name__ == "__main__":
    main()
