"""Soak: a long run with asynchronous checkpoints keeps a flat footprint.

2 CPU Ray Train workers, full_shard, the example decoder, AdamW, an async
checkpoint every ``every`` steps to the moto S3 server, ``num_to_keep`` 2,
through :mod:`tests.fault_proxy` answering ``503 SlowDown`` to a fraction of
the checkpoint writes (so retries run all along: pyarrow's client tries
each request up to 3 times itself, and only a request refused past those
reaches the backend's retry layer, which ``storage_retries`` counts; at 10%
that is rare, and 0 is the usual count). Each worker samples its resident
memory, open file descriptors and threads at every save. The run is flat
when, after warm-up (the first eighth of the steps):

- the median RSS of the last eighth of the steps is at most
  ``max(2%, 16 MiB)`` above the median of the second eighth;
- descriptors and threads never exceed the second eighth's maximum by more
  than the asynchronous writer coming and going (2);
- no temporary files remain (the workers' ``TMPDIR`` is a fresh directory);
  files above a small threshold (64 KiB here) are streamed as multipart
  uploads, so the streaming path runs at every save;
- the store holds at most ``num_to_keep`` + 1 checkpoints at the end.

    python -m benchmarks.soak                      # 800 steps, every 10 (~10 min on 2 cores)
    python -m benchmarks.soak --steps 160 --every 4
    python -m benchmarks.soak --dim 320            # per-rank checkpoint files of ~15 MiB

Also reported: the median RSS of steps 300-400 of 800 (the fourth eighth)
against that of the last eighth (``rss_flat_mid``: within 16 MiB), and the
size of each rank's checkpoint file in the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import pyarrow.fs as pafs

MIB = 1024 * 1024
MODEL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=2, seq_len=32)
"""The example decoder at ``dim`` 64; ``--dim`` changes the width."""
BUCKET = "soak"


def train_soak(config: dict) -> dict:
    """The worker's loop: train, save asynchronously every ``every`` steps,
    sample the process's footprint at each save."""
    import psutil
    import torch

    import ray_fsdp_backend as rfb
    from benchmarks._workload import build_model, loss_fn, make_optimizer
    from ray_fsdp_backend.storage import retry, retrying_fs

    retrying_fs.STREAM_ABOVE_BYTES = config["stream_above"]
    ctx = rfb.get_context()
    torch.set_num_threads(1)
    model = ctx.wrap(build_model({**MODEL, "dim": config["dim"]}))
    opt = make_optimizer(model)
    extra = ctx.restore_checkpoint(model, opt)
    start = extra["step"] if extra else 0
    g = torch.Generator().manual_seed(1000 + ctx.world_rank)
    proc, samples = psutil.Process(), []
    for step in range(start + 1, config["steps"] + 1):
        seq = torch.randint(0, MODEL["vocab_size"], (4, MODEL["seq_len"] + 1), generator=g)
        opt.zero_grad()
        loss = loss_fn(model, seq[:, :-1], seq[:, 1:])
        loss.backward()
        opt.step()
        if step % config["every"]:
            continue
        ctx.save_checkpoint(model, opt, {"step": step}, extra_state={"step": step},
                            async_save=True)  # fmt: skip
        samples.append({"step": step, "rss": proc.memory_info().rss,
                        "fds": proc.num_fds(), "threads": proc.num_threads()})  # fmt: skip
    mine = {"samples": samples, "start": start, "retries": retry.STATS.snapshot()}
    everyone = [None] * ctx.world_size
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def run(*, steps=800, every=10, keep=2, throttle=0.1, stream_above=64 * 1024,
        workers=2, windows=8, dim=64) -> dict:  # fmt: skip
    """Run the soak (starts its own Ray cluster and moto S3 server); returns
    each worker's samples and the checks (see the module docstring, where
    ``windows`` is 8: the RSS medians compared are those of the second and
    the last ``steps / windows`` steps)."""
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_fsdp_backend as rfb
    from ray_fsdp_backend.checkpoint import CheckpointStore
    from ray_fsdp_backend.runtime.ray_start import init_ray
    from tests.conftest import S3Server, moto_server
    from tests.fault_proxy import FaultProxy

    with tempfile.TemporaryDirectory() as tmp, moto_server() as s3:
        proxy = FaultProxy(s3.port)
        proxy.throttle(throttle)
        fs = S3Server(proxy.port).filesystem()
        fs.create_dir(BUCKET)
        init_ray("local", num_cpus=workers + 1, include_dashboard=True,
                 log_to_driver=False, runtime_env={"env_vars": {"TMPDIR": tmp}})  # fmt: skip
        start = time.monotonic()
        try:
            result = TorchTrainer(
                train_soak,
                train_loop_config=dict(steps=steps, every=every, stream_above=stream_above,
                                       dim=dim),
                torch_config=rfb.FSDPConfig(use_fsdp=True, use_mixed_precision=False),
                scaling_config=ScalingConfig(num_workers=workers),
                run_config=RunConfig(name="soak", storage_path=f"{BUCKET}/runs",
                                     storage_filesystem=fs,
                                     checkpoint_config=CheckpointConfig(num_to_keep=keep)),
            ).fit()  # fmt: skip
        finally:
            ray.shutdown()
            proxy.close()
        seconds = time.monotonic() - start
        direct = S3Server(s3.port).filesystem()
        checkpoints = CheckpointStore(direct, f"{BUCKET}/runs/soak").list_checkpoints()
        last = pafs.FileSelector(f"{BUCKET}/runs/soak/{checkpoints[-1]}", recursive=True)
        shards = {i.base_name: i.size for i in direct.get_file_info(last)
                  if i.base_name.endswith(".distcp")}  # fmt: skip
        # torch creates its compile cache directory there on import: not a leftover.
        leftovers = [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")]
    out = summarize(result.return_value, steps=steps, windows=windows, keep=keep,
                    checkpoints=checkpoints, leftovers=leftovers,
                    injected=dict(proxy.injected))  # fmt: skip
    out["rank_file_mib"] = {name: size / MIB for name, size in shards.items()}
    settings = dict(steps=steps, every=every, keep=keep, throttle=throttle, workers=workers,
                    dim=dim)  # fmt: skip
    return {**out, "fit_s": seconds, "settings": settings}


def summarize(workers: list[dict], *, steps, windows, keep, checkpoints, leftovers,
              injected) -> dict:  # fmt: skip
    """Per worker: RSS medians of the second and last ``steps / windows``
    steps, descriptor and thread peaks, and whether each check holds."""
    eighth = steps // windows
    rows = []
    for rank, worker in enumerate(workers):
        samples = worker["samples"]
        warm = [s for s in samples if eighth < s["step"] <= 2 * eighth]
        late = [s for s in samples if s["step"] > steps - eighth]
        mid = [s for s in samples if 3 * eighth < s["step"] <= 4 * eighth]
        after = [s for s in samples if s["step"] > 2 * eighth]
        warm_rss = statistics.median(s["rss"] for s in warm)
        late_rss = statistics.median(s["rss"] for s in late)
        mid_rss = statistics.median(s["rss"] for s in mid)
        row = {
            "rank": rank,
            "rss_warm_mib": warm_rss / MIB,
            "rss_late_mib": late_rss / MIB,
            "rss_growth_mib": (late_rss - warm_rss) / MIB,
            "rss_mid_mib": mid_rss / MIB,
            "rss_growth_from_mid_mib": (late_rss - mid_rss) / MIB,
            "fds_warm_max": max(s["fds"] for s in warm),
            "fds_after_max": max(s["fds"] for s in after),
            "threads_warm_max": max(s["threads"] for s in warm),
            "threads_after_max": max(s["threads"] for s in after),
            "storage_retries": worker["retries"][0],
            "storage_retry_s": worker["retries"][1],
        }
        row["rss_flat"] = late_rss - warm_rss <= max(0.02 * warm_rss, 16 * MIB)
        row["rss_flat_mid"] = abs(late_rss - mid_rss) <= 16 * MIB
        row["fds_flat"] = row["fds_after_max"] <= row["fds_warm_max"] + 2
        row["threads_flat"] = row["threads_after_max"] <= row["threads_warm_max"] + 2
        rows.append(row)
    return {
        "workers": rows,
        "samples": [w["samples"] for w in workers],
        "checkpoints_left": checkpoints,
        "store_bounded": len(checkpoints) <= keep + 1,
        "temporary_files_left": leftovers,
        "faults_injected": injected,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--throttle", type=float, default=0.1)
    parser.add_argument("--dim", type=int, default=64, help="the decoder's width")
    parser.add_argument("--out", help="also write the samples and checks here (JSON)")
    args = parser.parse_args(argv)
    out = run(steps=args.steps, every=args.every, keep=args.keep, throttle=args.throttle,
              dim=args.dim)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    for rank, samples in enumerate(out["samples"]):
        print(f"worker {rank}: step rss_mib fds threads")
        for s in samples:
            print(f"  {s['step']:5d} {s['rss'] / MIB:8.1f} {s['fds']:4d} {s['threads']:4d}")
    print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=1))
    return out


if __name__ == "__main__":
    main()
