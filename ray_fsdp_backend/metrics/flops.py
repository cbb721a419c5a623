"""Step-metric arithmetic: model FLOPs per token, peak FLOP/s, MFU, the progress line.

PURE: ints, floats and strings in and out; no torch, no Ray. The side that
measures (timers, memory, cross-rank reductions) is
:class:`ray_fsdp_backend.metrics.reporting.StepMeter`.

FLOPs are counted as torchtitan counts them (``get_nparams_and_flops``):
``6 * N`` per token for the matmuls of forward and backward over the ``N``
non-embedding parameters, plus ``12 * n_layers * attn_width * seq_len`` for
the attention scores and their weighted sum (``attn_width = n_heads *
head_dim``; causal masking is not discounted). MFU is achieved FLOP/s over
the accelerator's dense peak for the compute dtype. Written here rather than
imported: torchtitan is not a dependency, and the formula is two lines.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Dense (no sparsity) peak per device, TFLOP/s, from the vendors' data sheets.
    # Matched against the device name: the longest name it contains wins
    # ("NVIDIA L40" is an L40, not an L4).
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "MI300X": {"bf16": 1307.0, "fp16": 1307.0, "fp32": 163.4},
}
"""Known accelerators: device-name substring -> compute dtype -> peak TFLOP/s.
``FSDPSettings.peak_tflops`` overrides it; a device not listed (and every
CPU) gets no MFU unless that is set."""

DTYPES = ("bf16", "fp16", "fp32")


def flops_per_token(num_params: int, *, n_layers: int, attn_width: int, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token, as torchtitan counts them.

    Args:
        num_params: non-embedding parameters (an output head tied to the
            embedding counts: it is a matmul).
        n_layers: transformer blocks.
        attn_width: ``n_heads * head_dim`` (the model width for most models).
        seq_len: tokens per sequence.
    """
    for name, value in (("num_params", num_params), ("n_layers", n_layers)):
        if value < 0:
            raise ValueError(f"{name}={value} must be non-negative")
    return 6 * num_params + 12 * n_layers * attn_width * seq_len


def resolve_peak_flops(
    device_name: str, dtype: str, override_tflops: float | None = None
) -> float | None:
    """Peak FLOP/s of one device for ``dtype`` (``bf16``, ``fp16``, ``fp32``):
    ``override_tflops`` when given, else :data:`PEAK_TFLOPS`, else None."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if override_tflops is not None:
        return override_tflops * 1e12
    known = [name for name in PEAK_TFLOPS if name.lower() in device_name.lower()]
    if not known:
        return None
    tflops = PEAK_TFLOPS[max(known, key=len)].get(dtype)
    return None if tflops is None else tflops * 1e12


def compute_dtype(use_mixed_precision: bool, bf16: bool) -> str:
    """The dtype matmuls run in under the backend's precision settings."""
    if not use_mixed_precision:
        return "fp32"
    return "bf16" if bf16 else "fp16"


def throughput_metrics(
    *,
    tokens: int,
    seconds: float,
    steps: int,
    world_size: int,
    flops_per_token: float | None,
    peak_flops: float | None,
) -> dict[str, float]:
    """Tokens/s (global and per rank), step time, achieved TFLOP/s per rank and
    MFU (percent) over a window of ``steps`` steps that trained ``tokens``
    tokens (all ranks together) in ``seconds``. TFLOP/s needs
    ``flops_per_token``; MFU also ``peak_flops`` (per device)."""
    seconds = max(seconds, 1e-9)
    tokens_per_s = tokens / seconds
    out = {
        "step_time_s": seconds / max(1, steps),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_rank": tokens_per_s / world_size,
    }
    if flops_per_token:
        flops_per_rank = flops_per_token * tokens_per_s / world_size
        out["tflops_per_rank"] = flops_per_rank / 1e12
        if peak_flops:
            out["mfu_pct"] = 100.0 * flops_per_rank / peak_flops
    return out


def format_progress(m: Mapping[str, float], total_steps: int) -> str:
    """One console line: step, loss, eval loss, a preference objective's reward
    margin and accuracy (and their held-out values), grad norm, lr, throughput,
    MFU, step time, peak memory and ETA; fields absent from ``m`` are left out."""
    parts = [f"step {m['step']:>{len(str(total_steps))}}/{total_steps}"]
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4f}")
    if "eval_loss" in m:
        parts.append(f"eval loss {m['eval_loss']:.4f}")
    for prefix in ("", "eval/"):  # preference objectives (docs/preference.md)
        if f"{prefix}rewards/margins" in m:
            label = "eval " if prefix else ""
            parts.append(
                f"{label}margin {m[f'{prefix}rewards/margins']:.3f} "
                f"acc {m[f'{prefix}rewards/accuracies']:.2f}"
            )
    if "reward/mean" in m:  # online RL (docs/rl.md)
        parts.append(
            f"reward {m['reward/mean']:.3f} kl {m['kl']:.4f} clip {m['clip_fraction']:.2f} "
            f"entropy {m['entropy']:.3f}"
        )
    if "grad_norm" in m:
        parts.append(f"grad norm {m['grad_norm']:.3f}")
    if "lr" in m:
        parts.append(f"lr {m['lr']:.2e}")
    parts.append(f"{m['tokens_per_s']:,.0f} tok/s ({m['tokens_per_s_per_rank']:,.0f}/rank)")
    if "mfu_pct" in m:
        parts.append(f"MFU {m['mfu_pct']:.1f}%")
    parts.append(f"{m['step_time_s'] * 1000:,.0f} ms/step")
    if "memory_peak_reserved_gib" in m:
        parts.append(f"mem {m['memory_peak_reserved_gib']:.2f} GiB")
    parts.append(f"ETA {format_eta(m['eta_s'])}")
    return " | ".join(parts)


def format_eta(seconds: float) -> str:
    """``HH:MM:SS``, with days in front past 24 hours (``1d 03:46:40``)."""
    days, rest = divmod(int(seconds), 86400)
    clock = time.strftime("%H:%M:%S", time.gmtime(rest))
    return f"{days}d {clock}" if days else clock
