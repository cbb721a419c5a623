"""GPU benchmark, a few minutes on one GPU: ``python -m benchmarks.gpu``.

1. NCCL: a world-size-1 process group bound to the GPU (``device_id``), as
   the backend creates it, and an all-reduce through it.
2. Training throughput of the example decoder (``--preset``, default ``1b``,
   ~1.0B parameters) under FSDP2 with bf16 compute: tokens/s and MFU (model
   FLOPs per token x tokens/s over the GPU's dense bf16 peak), for our
   ``strategy.wrap`` + ``clip_grad_norm`` path and for the same model wrapped
   by hand with ``fully_shard``, alternating, with their ratio.
3. Newton-Schulz TFLOP/s in bf16 for the batch shapes DMuon orthogonalises in
   that model (all layers' matrices of one shape in one call).
4. CPU offload + HSDP + DMuon through ``build_strategy`` on the process group
   the backend would create (``cuda:nccl,cpu:gloo``): a few steps train with
   finite losses, shards stay on the host, buffers sit on the GPU.

``--sustained`` runs the sustained benchmark instead (200 steps of the
training loop, eager and compiled, NVML and a profiler trace:
:mod:`benchmarks.sustained`). Without a CUDA GPU it prints why and exits 0,
so it runs unchanged wherever it is started. ``--out`` writes the results
as JSON. ``--cpu`` runs the same measurements on the CPU with gloo (the
test suite's smoke run, with ``--preset tiny``; no MFU without a known
peak).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks._device import init_single_rank, pick_device
from ray_fsdp_backend.metrics.flops import resolve_peak_flops


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def process_group_check(device: torch.device) -> dict:
    t = torch.ones(1024, device=device)
    dist.all_reduce(t)
    _sync(device)
    return {"backend": dist.get_backend(), "all_reduce_ok": bool((t == 1).all())}


def _build_models(preset: dict, device: torch.device):
    """(ours, hand-written) FSDP2 decoders built on meta and materialised on ``device``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ray_fsdp_backend import FSDPConfig, build_strategy
    from ray_fsdp_backend.models.decoder import ModelConfig, Transformer

    cfg = ModelConfig(**preset)
    strategy = build_strategy(
        FSDPConfig(use_fsdp=True, bf16=True, use_mixed_precision=True),
        device=device,
        local_rank=0,
    )
    with torch.device("meta"):
        ours = Transformer(cfg)
        hand = Transformer(cfg)
    ours = strategy.wrap(ours)

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in hand.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(hand, mesh=mesh, mp_policy=mp)
    hand.to_empty(device=device)
    hand.init_weights()
    return cfg, strategy, ours, hand


def _step_fn(model, device, batch, seq_len, vocab, clip: Callable) -> Callable[[], None]:
    from benchmarks import _workload

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), device=device, generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _workload.loss_fn(model, x, y).backward()
        clip(model)
        opt.step()

    return step


def throughput(preset: dict, device: torch.device, *, batch: int, steps: int, reps: int) -> dict:
    """Tokens/s and MFU of ours vs hand-written FSDP2, alternating blocks of ``steps``."""
    cfg, strategy, ours, hand = _build_models(preset, device)
    seq = cfg.seq_len
    candidates = {
        "ours": _step_fn(ours, device, batch, seq, cfg.vocab_size,
                         lambda m: strategy.clip_grad_norm(m, 1.0)),
        "hand": _step_fn(hand, device, batch, seq, cfg.vocab_size,
                         lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)),
    }  # fmt: skip
    for step in candidates.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for rep in range(reps):
        for name in list(candidates) if rep % 2 == 0 else list(candidates)[::-1]:
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                candidates[name]()
            _sync(device)
            times[name].append((time.perf_counter() - start) / steps)
    tokens = batch * seq
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_flops = resolve_peak_flops(name, "bf16")
    peak = None if peak_flops is None else peak_flops / 1e12
    out = {"device": name, "params": cfg.num_params(), "batch": batch, "seq_len": seq,
           "peak_bf16_tflops": peak}  # fmt: skip
    for key, values in times.items():
        tokens_per_s = tokens / statistics.median(values)
        achieved = cfg.flops_per_token() * tokens_per_s / 1e12
        out[key] = {
            "step_s": statistics.median(values),
            "tokens_per_s": tokens_per_s,
            "model_tflops": achieved,
            "mfu": achieved / peak if peak else None,
        }
    out["ratio_ours_over_hand"] = statistics.median(
        a / b for a, b in zip(times["ours"], times["hand"], strict=True)
    )
    if device.type == "cuda":
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def dmuon_shapes(preset: dict) -> dict[tuple[int, int], int]:
    """How many matrices of each shape DMuon orthogonalises in the decoder."""
    from ray_fsdp_backend.models.decoder import ModelConfig, Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(**preset))
    shapes: dict[tuple[int, int], int] = {}
    for p in model.layers.parameters():
        if p.ndim == 2:
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    return shapes


def ns_flops(batch: int, rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``steps`` quintic iterations on a (batch, rows, cols) stack:
    per iteration A = X X^T (2 m^2 n), A^2 (2 m^3), (bA + cA^2) X (2 m^2 n),
    with m <= n after the transpose."""
    m, n = min(rows, cols), max(rows, cols)
    return batch * steps * (4 * m * m * n + 2 * m**3)


def newton_schulz(preset: dict, device: torch.device, *, reps: int) -> list[dict]:
    from ray_fsdp_backend.dmuon.newton_schulz import NS_STEPS, zeropower_via_newtonschulz

    rows = []
    for (r, c), count in sorted(dmuon_shapes(preset).items()):
        stack = torch.randn(count, r, c, device=device)
        zeropower_via_newtonschulz(stack, dtype=torch.bfloat16)
        times = []
        for _ in range(reps):
            _sync(device)
            start = time.perf_counter()
            zeropower_via_newtonschulz(stack, dtype=torch.bfloat16)
            _sync(device)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rows.append({"shape": [count, r, c], "ms": 1e3 * seconds,
                     "tflops": ns_flops(count, r, c, NS_STEPS) / seconds / 1e12})  # fmt: skip
    return rows


def offload_hsdp_dmuon(preset: dict, device: torch.device, *, batch: int, steps: int) -> dict:
    """A few DMuon steps of the example decoder under HSDP with CPU offload."""
    import math

    from benchmarks import _workload
    from ray_fsdp_backend import FSDPConfig, build_strategy
    from ray_fsdp_backend.dmuon.optimizer import Muon
    from ray_fsdp_backend.models.decoder import ModelConfig, Transformer

    cfg = ModelConfig(**preset)
    config = FSDPConfig(use_fsdp=True, fsdp_sharding_strategy="hybrid_shard",
                        fsdp_cpu_offload=True, use_dmuon=True)  # fmt: skip
    strategy = build_strategy(config, device=device, local_rank=0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = strategy.wrap(model)
    opt = Muon(model, lr=0.02)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device=device)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _workload.loss_fn(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        strategy.clip_grad_norm(model, 1.0, optimizer=opt)
        opt.step()
        losses.append(float(loss))
    return {
        "backend": str(dist.get_backend()),
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "shard_devices": sorted({p.to_local().device.type for p in model.parameters()}),
        "buffer_devices": sorted({b.device.type for b in model.buffers()}),
    }


def run(preset: dict, device: torch.device, *, batch: int, steps: int, reps: int) -> dict:
    """Every GPU measurement (also runs on CPU with tiny sizes, for the smoke test)."""
    init_single_rank(device)
    try:
        return {
            "process_group": process_group_check(device),
            "throughput": throughput(preset, device, batch=batch, steps=steps, reps=reps),
            "newton_schulz_bf16": newton_schulz(preset, device, reps=reps),
            "offload_hsdp_dmuon": offload_hsdp_dmuon(preset, device, batch=batch, steps=steps),
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict | None:
    from ray_fsdp_backend.models.decoder import PRESETS

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sustained" in argv:  # its own options: see benchmarks/sustained.py
        from benchmarks import sustained

        return sustained.main([a for a in argv if a != "--sustained"])

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="1b")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=4, help="alternating blocks per candidate")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with gloo (smoke run)")
    parser.add_argument("--sustained", action="store_true", help="see benchmarks/sustained.py")
    args = parser.parse_args(argv)
    device = pick_device(args.cpu, "benchmarks.gpu")
    if device is None:
        return None
    results = run(PRESETS[args.preset], device, batch=args.batch, steps=args.steps,
                  reps=args.reps)  # fmt: skip
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
