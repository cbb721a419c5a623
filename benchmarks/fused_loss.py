"""The loss at large vocabularies: chunked ``rfb.linear_cross_entropy``
(eager and ``compile=True``) against ``F.cross_entropy`` on the full fp32
logits, side by side.

For each vocabulary (Llama 3 128,256; Qwen 2.5/3 151,936; Gemma 3 262,144)
and token count, the head's forward and backward with its loss (``hidden @
weight.T`` then cross-entropy, gradients of both) runs in turn compiled,
chunked (eager) and full, ``--repeats`` times, in rotating order, after one
untimed call of each (the compiled one compiles there). Peak memory is the
largest rise of the host allocator's total over the call (the profiler's
allocation records, as tests/unit/test_linear_cross_entropy.py watches
them); time is the median. Ratios are against the full logits.

On CPU the token counts are scaled down from the 16k-64k of a GPU
micro-batch (the full logits of 64k tokens x 262k words are 69 GB in fp32,
three times that with log-softmax and gradient); memory scales linearly in
tokens for the full path and not at all for the fused one, so the ratios
at larger counts only fall.

    python -m benchmarks.fused_loss                      # about 4 minutes on 2 cores
    python -m benchmarks.fused_loss --tokens 1024 --vocab 151936 --chunks 512 1024 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ray_fsdp_backend.ops.loss import linear_cross_entropy


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

    def chunked(compile: bool = False):
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, compile=compile)
        loss.backward()
        hidden.grad = weight.grad = None

    return {"compiled": lambda: chunked(compile=True), "chunked": chunked, "full": full}


def measure(tokens: int, vocab: int, dim: int, chunk: int, repeats: int) -> dict:
    """Peak bytes and median seconds of each loss (compiled, chunked, full)."""
    cases = _cases(tokens, vocab, dim, chunk)
    order = list(cases.items())
    for _, fn in order:  # warm-up: the compiled loss compiles here
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats):
        for name, fn in order[i % 3 :] + order[: i % 3]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    peaks = {name: peak_rise(host_allocations(fn)) for name, fn in order}
    return {name: (peaks[name], statistics.median(times[name])) for name in cases}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        "| vocab | tokens | chunk | compiled MiB | chunked MiB | full MiB "
        "| memory compiled/full | chunked/full | compiled ms | chunked ms | full ms "
        "| time compiled/full | chunked/full |"
    )
    print("|---" * 13 + "|")
    for vocab in args.vocab:
        for tokens in args.tokens:
            for chunk in args.chunks:
                print(
                    _row(
                        tokens, vocab, chunk, measure(tokens, vocab, args.dim, chunk, args.repeats)
                    ),
                    flush=True,
                )


def _row(tokens: int, vocab: int, chunk: int, r: dict) -> str:
    """One table row: peaks in MiB, times in ms, ratios against the full logits."""
    (cp, cs), (ep, es), (fp, fs) = r["compiled"], r["chunked"], r["full"]
    mib = 2**20
    return (
        f"| {vocab:,} | {tokens:,} | {chunk:,} | {cp / mib:,.0f} | {ep / mib:,.0f} "
        f"| {fp / mib:,.0f} | {cp / fp:.3f} | {ep / fp:.3f} | {cs * 1e3:,.0f} "
        f"| {es * 1e3:,.0f} | {fs * 1e3:,.0f} | {cs / fs:.2f} | {es / fs:.2f} |"
    )


if __name__ == "__main__":
    main()
