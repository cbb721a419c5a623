"""The loss at large vocabularies: chunked ``rfb.linear_cross_entropy``
against ``F.cross_entropy`` on the full fp32 logits, side by side.

For each vocabulary (Llama 3 128,256; Qwen 2.5/3 151,936; Gemma 3 262,144)
and token count, the head's forward and backward with its loss (``hidden @
weight.T`` then cross-entropy, gradients of both) runs alternately fused
and full, ``--repeats`` times. Peak memory is the largest rise of the
host allocator's total over the call (the profiler's allocation records,
as tests/unit/test_linear_cross_entropy.py watches them); time is the
median. Ratios are fused / full.

On CPU the token counts are scaled down from the 16k-64k of a GPU
micro-batch (the full logits of 64k tokens x 262k words are 69 GB in fp32,
three times that with log-softmax and gradient); memory scales linearly in
tokens for the full path and not at all for the fused one, so the ratios
at larger counts only fall.

    python -m benchmarks.fused_loss                      # about 5 minutes on 2 cores
    python -m benchmarks.fused_loss --tokens 1024 --vocab 151936 --chunks 512 1024 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ray_fsdp_backend.loss import linear_cross_entropy


def host_allocations(fn) -> list[int]:
    """Every host allocation (+bytes) and free (-bytes) ``fn`` makes, in
    order (the profiler's allocation records)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    found: list[tuple[int, int]] = []

    def walk(node):
        if node.tag == torch._C._profiler._EventType.Allocation:
            found.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return [size for _, size in sorted(found)]


def peak_rise(sizes: list[int]) -> int:
    """Largest rise of allocated bytes over a sequence of allocations and frees."""
    total = peak = 0
    for size in sizes:
        total += size
        peak = max(peak, total)
    return peak


def _cases(tokens: int, vocab: int, dim: int, chunk: int):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)

    def full():
        F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum").backward()
        hidden.grad = weight.grad = None

    def fused():
        linear_cross_entropy(hidden, weight, labels, chunk_size=chunk).backward()
        hidden.grad = weight.grad = None

    return fused, full


def measure(tokens: int, vocab: int, dim: int, chunk: int, repeats: int) -> dict:
    """Peak bytes and median seconds of the fused and the full loss."""
    fused, full = _cases(tokens, vocab, dim, chunk)
    times: dict[str, list[float]] = {"fused": [], "full": []}
    for i in range(repeats):
        order = [("fused", fused), ("full", full)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {
        "fused_peak": peak_rise(host_allocations(fused)),
        "full_peak": peak_rise(host_allocations(full)),
        "fused_s": statistics.median(times["fused"]),
        "full_s": statistics.median(times["full"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936, 262144])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(
        "| vocab | tokens | chunk | fused MiB | full MiB | memory fused/full "
        "| fused ms | full ms | time fused/full |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 2**20
    for vocab in args.vocab:
        for tokens in args.tokens:
            for chunk in args.chunks:
                r = measure(tokens, vocab, args.dim, chunk, args.repeats)
                print(
                    f"| {vocab:,} | {tokens:,} | {chunk:,} | {r['fused_peak'] / mib:,.0f} "
                    f"| {r['full_peak'] / mib:,.0f} | {r['fused_peak'] / r['full_peak']:.3f} "
                    f"| {r['fused_s'] * 1e3:,.0f} | {r['full_s'] * 1e3:,.0f} "
                    f"| {r['fused_s'] / r['full_s']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
