"""Comparison 7: loading a pretrained Hugging Face checkpoint onto N ranks.

**A (ours)**: build the model on the meta device, ``wrap`` it (FSDP2
full_shard), ``load_pretrained``: each rank reads the byte ranges it owns.

**B (the usual way)**: ``AutoModelForCausalLM.from_pretrained`` on every
rank (the whole model in host memory), then ``wrap``.

Each side runs in its own spawned job per world size (a process's memory
high-water mark cannot be reset; ``--quick`` runs them in one job, its peaks
not isolated), A and B alternating. Peak host memory is the largest
resident set a background thread sees during the load, minus the
resident set just before it: what the load adds, per rank. Time is from
before the model is built to the end of the load, on the slowest rank; the
load repeats ``reps`` times in the job and the median is reported.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time

import torch

from benchmarks import _measure

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Largest resident set seen while the ``with`` block runs, above the start."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.added = self.peak - self.start


def _ours(path, strategy):
    from ray_fsdp_backend import load_pretrained
    from ray_fsdp_backend.hf.models import build_causal_lm

    model = strategy.wrap(build_causal_lm(path))
    load_pretrained(model, path)
    return model


def _full(path, strategy):
    from transformers import AutoModelForCausalLM

    return strategy.wrap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))


def on_rank(rank: int, world: int, path: str, side: str, reps: int) -> dict:
    # Modules both sides use are imported before measuring: imports are not loads.
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import ray_fsdp_backend.hf.models  # noqa: F401
    from ray_fsdp_backend import FSDPSettings, build_strategy

    config = FSDPSettings(use_fsdp=True, use_mixed_precision=False)
    load = _ours if side == "ours" else _full
    times = []
    for rep in range(reps):
        strategy = build_strategy(config, device=torch.device("cpu"), local_rank=rank)
        _measure.barrier()
        with PeakRSS() as mem:
            start = time.perf_counter()
            model = load(path, strategy)
            _measure.barrier()
            times.append(time.perf_counter() - start)
        if rep == 0:
            peak = _measure.max_over_ranks([float(mem.added)])[0]
        del model
    return {
        "peak_bytes_per_rank": peak,
        "load_s": statistics.median(_measure.max_over_ranks(times)),
    }


def make_checkpoint(
    dim: int, layers: int, vocab: int, root: str, multiple_of: int = 1
) -> tuple[str, int]:
    """A random Llama of this size in bf16 safetensors shards; (path, bytes).
    ``multiple_of``: the MLP width rounded up to it (Llama's own rule; 256
    lets NF4 blocks divide every shard)."""
    import transformers as tf

    hidden = -(-8 * dim // 3 // multiple_of) * multiple_of
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, dim // 64), num_key_value_heads=max(1, dim // 64),
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    path = os.path.join(root, "ckpt")
    model.save_pretrained(path, max_shard_size="50MB")
    size = sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )
    return path, size


def run(run_ranks, worlds, dim, layers, vocab, reps, one_spawn=False) -> dict:
    """Both sides at each world size; ``run_ranks`` is the gloo harness;
    ``one_spawn``: both sides in one job per world size (:func:`_measure.run_sides`)."""
    with tempfile.TemporaryDirectory() as root:
        path, size = make_checkpoint(dim, layers, vocab, root)
        params = size // 2
        rows = []
        for i, world in enumerate(worlds):
            order = ("ours", "full") if i % 2 == 0 else ("full", "ours")
            got = _measure.run_sides(
                run_ranks, on_rank, world, path, order, reps, one_spawn=one_spawn
            )
            rows.append({"world_size": world, **got})
    return {"checkpoint_bytes": size, "params": params, "fp32_bytes": 4 * params, "rows": rows}
