"""Context parallelism on CPU: activation memory per rank and tokens/s
against sequence length, at cp 1, 2 and 4 (Ulysses over gloo).

``--packed``: rows packed from 200 to 2,000-token documents (the
per-document attention) and, per rank, the largest tensor any op of the
forward and backward returns (a dispatch-mode watch), against ``seq x seq``:
the dense document mask this kernel replaced was one such tensor per row.

One spawned job per cp size runs every sequence length: the project's
decoder (tiny: dim 64, 2 layers, 4 heads), one row per step (the same global
batch at every cp size: the cp ranks split that row), weights replicated
(no FSDP: what is measured is the activations and the attention exchange).
Activation memory is what autograd saves for backward in one forward
(distinct storages, weights excluded, measured with
``torch.autograd.graph.saved_tensors_hooks``); tokens/s is the row's tokens
over the median forward+backward time.

    python -m benchmarks.long_context            # 2k-8k tokens, a few minutes on 2 cores
    python -m benchmarks.long_context --seq 2048 4096
    python -m benchmarks.long_context --packed --seq 2048 8192 32768
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ray_fsdp_backend.context_parallel import (
    apply_context_parallel,
    pack_documents,
    shard_sequence,
)
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer

REPEATS = 3


def saved_bytes(model, *inputs) -> int:
    """Distinct storages autograd saves in one forward, weights excluded."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs).float().sum().backward()
    return sum(storages.values())


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def one_row(seq: int, packed: bool) -> dict[str, torch.Tensor]:
    """One row of ``seq`` tokens: a single document, or packed documents."""
    g = torch.Generator().manual_seed(1)
    if not packed:
        return {"input_ids": torch.randint(0, 256, (1, seq), generator=g)}
    lengths = torch.randint(200, 2000, (seq // 200 + 1,), generator=g).tolist()
    docs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    return pack_documents(docs, seq, rows=1)


def measure(rank: int, world: int, seq_lens: list[int], packed: bool = False) -> list[dict]:
    rows = []
    for seq in seq_lens:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(dim=64, n_layers=2, n_heads=4, seq_len=seq))
        if world > 1:
            model = apply_context_parallel(model, dist.group.WORLD)
        shard = shard_sequence(one_row(seq, packed), rank, world)
        inputs = (shard["input_ids"], shard["position_ids"])
        with LargestTensor() as watch:
            activations = saved_bytes(model, *inputs)
        times = []
        for _ in range(REPEATS):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            model(*inputs).float().sum().backward()
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "seq": seq,
                "cp": world,
                "activations": activations,
                "largest": watch.largest,
                "seconds": statistics.median(times),
            }
        )
    return rows


def run(cp_sizes: list[int], seq_lens: list[int], packed: bool = False) -> list[dict]:
    from tests.dist.harness import run_ranks

    results = []
    for cp in cp_sizes:
        if cp == 1:
            results += measure(0, 1, seq_lens, packed)
        else:
            results += run_ranks(measure, cp, seq_lens, packed)
    return results


def table(results: list[dict]) -> str:
    base = {r["seq"]: r for r in results if r["cp"] == 1}
    lines = [
        "| tokens | cp | activations per rank | vs cp 1 | largest tensor / seq² "
        "| step (fwd+bwd) | tokens/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(results, key=lambda r: (r["seq"], r["cp"])):
        ratio = r["activations"] / base[r["seq"]]["activations"] if r["seq"] in base else 0
        lines.append(
            f"| {r['seq']} | {r['cp']} | {r['activations'] / 2**20:.1f} MiB | {ratio:.2f} | "
            f"{r['largest'] / r['seq'] ** 2:.4f} | {r['seconds'] * 1e3:.0f} ms | "
            f"{r['seq'] / r['seconds']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--packed", action="store_true", help="packed documents per row")
    args = parser.parse_args(argv)
    print(table(run(args.cp, args.seq, args.packed)))


if __name__ == "__main__":
    main()
