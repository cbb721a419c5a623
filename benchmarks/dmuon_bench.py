"""DMuon optimizer-step benchmark: time, bytes on the wire and memory per rank.

For each model width in ``sizes`` (a transformer-like stack: per layer a
``qkv`` (3d x d), ``out`` (d x d), ``up`` (4d x d) and ``down`` (d x 4d)
matrix), it measures

- ``torch.optim.Muon`` on one process over the full matrices (the reference);
- ``ray_fsdp_backend.dmuon.Muon`` on FSDP2 shards at each rank count in
  ``ranks`` (gloo on CPU, one spawn per rank count covering all sizes): step
  time (slowest rank), time in Newton–Schulz per rank, bytes each rank sends
  and receives in the two exchanges, momentum bytes per rank and matrices
  orthogonalised per rank, and each rank's CPU time per step over that of
  ``torch.optim.Muon`` (robust to other load on a shared machine);
- for comparison, the bytes a plain FSDP2 + AdamW training step moves per
  rank (all-gather in forward, again in backward, reduce-scatter of the
  gradients; the AdamW step itself moves nothing) and what a naive
  "all-gather every matrix on every rank" Muon would add.

Every process runs one intra-op thread (on a shared machine OpenMP threads
that wait for a busy core make timings meaningless), and times are medians:
at ``r`` ranks DMuon uses ``r`` cores, the reference one. With more ranks
than cores both sides are oversubscribed alike (every rank also runs the
reference); the per-rank Newton–Schulz time (``ns_ms_per_rank``) shows the
work split even where the cores run out.

    python -m benchmarks.dmuon_bench            # prints JSON
    python -m benchmarks.dmuon_bench --sizes 64 128 256 512 --ranks 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from benchmarks import _measure

FP32_BYTES = 4


MATRICES = {"qkv": (3, 1), "out": (1, 1), "up": (4, 1), "down": (1, 4)}
"""A layer's matrices: (rows, cols) in multiples of d_model."""


class Layer(nn.Module):
    def __init__(self, d: int, names: tuple[str, ...] = tuple(MATRICES)):
        super().__init__()
        for name in names:
            rows, cols = MATRICES[name]
            setattr(self, name, nn.Linear(cols * d, rows * d, bias=False))


class Stack(nn.Module):
    def __init__(self, d: int, n_layers: int, names: tuple[str, ...] = tuple(MATRICES)):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d, names) for _ in range(n_layers))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _fill_grads(model: nn.Module, seed: int) -> None:
    """Random gradients (this rank's rows only, for sharded parameters)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
        _local(p.grad).copy_(torch.randn(_local(p).shape, generator=g))


def _torch_muon(d: int, n_layers: int, names=tuple(MATRICES)) -> torch.optim.Optimizer:
    """``torch.optim.Muon`` (bf16 Newton–Schulz) on full, unsharded matrices."""
    torch.manual_seed(0)
    model = Stack(d, n_layers, names)
    _fill_grads(model, 0)
    return torch.optim.Muon(model.parameters(), lr=0.02)


def _dmuon_on_ranks(
    rank: int, world_size: int, sizes, n_layers: int, reps: int, steps: int
) -> list[dict]:
    """Run on every rank: one DMuon measurement per size; rank 0 returns all.

    DMuon's step alternates with ``torch.optim.Muon`` over the full matrices,
    which every rank runs on its own at the same time (one core each): the
    single-process reference, measured beside DMuon under the same load.
    """
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    out = []
    for d in sizes:
        opt = _sharded_muon(mesh, rank, d, n_layers)
        reference = _torch_muon(d, n_layers)
        opt.step(), reference.step()  # warm-up outside the timers
        with _NSTimer() as ns:
            times = _measure.alternate(
                {"dmuon": opt.step, "torch_muon": reference.step},
                reps=reps, steps=steps, warmup=0,
            )  # fmt: skip
        stats = opt.last_step_stats
        row = dict(
            cpu_ratio=_cpu_time_ratio(opt.step, reference.step, reps),
            ns_s=ns.seconds / (reps * steps),
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            momentum_bytes=opt.momentum_numel() * FP32_BYTES,
            ns_matrices=len(stats.orthogonalized),
        )
        rows = [None] * world_size
        dist.all_gather_object(rows, row)
        out.append({**_measure.compare(times["dmuon"], times["torch_muon"]),
                    **_summarise_ranks(rows)})  # fmt: skip
    return out


def _sharded_muon(mesh, rank: int, d: int, n_layers: int, names=tuple(MATRICES), **kwargs):
    """DMuon on an FSDP2-sharded ``Stack`` with random gradients."""
    from torch.distributed.fsdp import fully_shard

    from ray_fsdp_backend.dmuon import Muon

    torch.manual_seed(0)
    model = Stack(d, n_layers, names)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model, lr=0.02, **kwargs)
    _fill_grads(model, rank)
    return opt


def _cpu_time_ratio(dmuon_step, torch_step, reps: int) -> float:
    """Median over ``reps`` alternating pairs of this process's CPU time in
    one DMuon step over that of one ``torch.optim.Muon`` step: unlike wall
    time, not inflated by other processes on a shared machine (at several
    ranks it is this rank's share of the work, waiting excluded)."""
    ratios = []
    for rep in range(reps):
        spent = {}
        pair = [("dmuon", dmuon_step), ("torch", torch_step)]
        for name, step in pair if rep % 2 == 0 else pair[::-1]:
            start = time.process_time()
            step()
            spent[name] = time.process_time() - start
        ratios.append(spent["dmuon"] / spent["torch"])
    return statistics.median(ratios)


class _NSTimer:
    """Seconds spent in DMuon's Newton–Schulz calls while active."""

    NAMES = ("zeropower_via_newtonschulz",)

    def __enter__(self):
        from ray_fsdp_backend.dmuon import newton_schulz

        self.module, self.seconds = newton_schulz, 0.0
        self.real = {name: getattr(newton_schulz, name) for name in self.NAMES}
        for name, real in self.real.items():
            setattr(newton_schulz, name, self._timed(real))
        return self

    def _timed(self, real):
        def timed(*args):
            start = time.perf_counter()
            out = real(*args)
            self.seconds += time.perf_counter() - start
            return out

        return timed

    def __exit__(self, *exc):
        for name, real in self.real.items():
            setattr(self.module, name, real)


def _summarise_ranks(rows: list[dict]) -> dict:
    return {
        "ns_ms_per_rank": [round(1e3 * r["ns_s"], 3) for r in rows],
        "cpu_ratio_per_rank": [round(r["cpu_ratio"], 3) for r in rows],
        "bytes_sent_per_rank": max(r["bytes_sent"] for r in rows),
        "bytes_received_per_rank": max(r["bytes_received"] for r in rows),
        "momentum_bytes_per_rank": [r["momentum_bytes"] for r in rows],
        "ns_matrices_per_rank": [r["ns_matrices"] for r in rows],
    }


def analytic_bytes(d: int, n_layers: int, world_size: int) -> dict:
    """Per-rank bytes of a plain FSDP2 + AdamW training step and of a naive
    replicated-NS Muon, for fp32 parameters (ring collectives: each rank
    sends ``(n - 1) / n`` of the tensor per all-gather or reduce-scatter)."""
    param_bytes = sum(p.numel() for p in Stack(d, 1).parameters()) * n_layers * FP32_BYTES
    frac = (world_size - 1) / world_size
    return {
        "param_bytes": param_bytes,
        "fsdp_adamw_step_bytes_per_rank": int(3 * frac * param_bytes),
        "naive_allgather_muon_extra_bytes_per_rank": int(frac * param_bytes // 2),  # bf16
    }


def run(
    sizes: tuple[int, ...] = (64, 128, 256, 512),
    ranks: tuple[int, ...] = (1, 2, 4),
    n_layers: int = 4,
    reps: int = 5,
    steps: int = 2,
    run_ranks=None,
) -> dict:
    """Benchmark results as a JSON-ready dict (see the module docstring);
    ``run_ranks``: the gloo harness's (the default) or a rank pool's."""
    if run_ranks is None:
        from tests.dist.harness import run_ranks

    dmuon = {r: run_ranks(_dmuon_on_ranks, r, tuple(sizes), n_layers, reps, steps) for r in ranks}
    results = []
    for k, d in enumerate(sizes):
        row = {"d_model": d, "n_layers": n_layers, "num_matrices": 4 * n_layers}
        row["momentum_bytes_single_process"] = analytic_bytes(d, n_layers, 1)["param_bytes"]
        row["dmuon"] = {str(r): {**dmuon[r][k], **analytic_bytes(d, n_layers, r)} for r in ranks}
        results.append(row)
    return {
        "benchmark": "dmuon_step",
        "backend": "gloo/cpu",
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    result = run(tuple(args.sizes), tuple(args.ranks), args.layers, args.reps, args.steps)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
