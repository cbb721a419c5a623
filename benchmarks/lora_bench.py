"""Comparison 10: LoRA vs full fine-tuning of one pretrained model on N ranks.

The same pretrained Llama (bf16 safetensors, trained in fp32, FSDP2
full_shard) is trained three ways: every parameter (**full**), and LoRA
adapters of rank 8 and 64 on ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``
over the frozen base (``alpha = 2 r``), and QLoRA r 8 (the same adapters
over the base loaded with ``quantize="nf4"``). Each side runs in its own spawned
job per world size (a process's memory high-water mark cannot be reset;
``--quick`` runs them in one job, its peaks not isolated), in alternating
order. Per rank (the largest over ranks): model-state bytes
(parameters, gradients, optimizer state, read off the tensors; the frozen
base's bytes with NF4 codes and scales counted as stored), the peak
resident set the training steps add, the median step time, and the bytes
of one checkpoint save (all ranks' files).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks import _measure
from benchmarks.pretrained import PeakRSS, make_checkpoint

SIDES = {"full": None, "lora_r8": 8, "lora_r64": 64, "qlora_r8": 8}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _build(rank: int, path: str, side: str):
    from ray_fsdp_backend import FSDPSettings, build_strategy, load_pretrained
    from ray_fsdp_backend.hf.models import build_causal_lm
    from ray_fsdp_backend.trainer.schema.lora import LoraOptions, apply_lora

    config = FSDPSettings(use_fsdp=True, use_mixed_precision=False)
    strategy = build_strategy(config, device=torch.device("cpu"), local_rank=rank)
    model = build_causal_lm(path)
    rank_r = SIDES[side]
    if rank_r is not None:
        model = apply_lora(model, LoraOptions(r=rank_r, alpha=2 * rank_r, target_modules=TARGETS))
    model = strategy.wrap(model)
    load_pretrained(model, path, quantize="nf4" if side.startswith("qlora") else None)
    return strategy, model


def on_rank(rank: int, world: int, path: str, side: str, steps: int, batch: int, seq: int) -> dict:
    from ray_fsdp_backend.checkpoint import CheckpointStore, save_sharded
    from ray_fsdp_backend.ops.quantization import nf4_bytes

    torch.set_num_threads(1)
    strategy, model = _build(rank, path, side)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    vocab = model.config.vocab_size
    times = []
    _measure.barrier()
    with PeakRSS() as mem:
        for step in range(steps + 1):  # the first step allocates state: not timed
            g = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(0, vocab, (batch, seq), generator=g)
            start = time.perf_counter()
            logits = model(ids).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            strategy.clip_grad_norm(model, 1.0, optimizer=opt)
            opt.step()
            _measure.barrier()
            if step:
                times.append(time.perf_counter() - start)
            opt.zero_grad(set_to_none=False)  # keep gradient buffers for the byte count
    state = _measure.state_bytes(model, opt)
    split = nf4_bytes(model)
    quantised = sum(
        p._local_tensor.numel() for p in model.parameters() if hasattr(p, "_local_tensor")
        and hasattr(p._local_tensor, "quantized_data")
    )  # fmt: skip
    base = _measure.max_over_ranks([float(split["nf4"] + split["dense"]), float(split["nf4"])])
    peak = _measure.max_over_ranks([float(mem.added)])[0]
    with tempfile.TemporaryDirectory() as root:
        root = _same_dir(root)
        start = time.perf_counter()
        name = save_sharded(CheckpointStore.local(root), model, opt)
        save_s = time.perf_counter() - start
        folder = os.path.join(root, name)
        saved = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        _measure.barrier()
    return {
        "trainable_params": sum(p.numel() for p in trainable),
        "state": state,
        "base_bytes_per_rank": int(base[0]),
        # The NF4 weights' stored bytes per rank, and how many of them: NF4 vs bf16.
        "nf4_bytes_per_rank": int(base[1]),
        "nf4_params_per_rank": quantised,
        "peak_bytes_per_rank": peak,
        "step_s": statistics.median(_measure.max_over_ranks(times)),
        "checkpoint_bytes": saved,
        "save_s": save_s,
    }


def _same_dir(local: str) -> str:
    """Rank 0's temporary directory on every rank (one checkpoint for all)."""
    box = [local]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def run(run_ranks, worlds, dim, layers, vocab, steps, batch, seq, one_spawn=False) -> dict:
    """Every side at each world size; ``run_ranks`` is the gloo harness;
    ``one_spawn``: all sides in one job per world size (:func:`_measure.run_sides`)."""
    with tempfile.TemporaryDirectory() as root:
        path, size = make_checkpoint(dim, layers, vocab, root, multiple_of=256)
        rows = []
        for i, world in enumerate(worlds):
            order = list(SIDES) if i % 2 == 0 else list(reversed(SIDES))
            args = (steps, batch, seq)
            got = _measure.run_sides(
                run_ranks, on_rank, world, path, order, *args, one_spawn=one_spawn
            )
            rows.append({"world_size": world, **{s: got[s] for s in SIDES}})
    return {"params": size // 2, "batch": batch, "seq": seq, "rows": rows}
