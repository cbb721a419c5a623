"""Sustained GPU throughput: ``python -m benchmarks.gpu --sustained --out DIR``.

200 steps of the 1B preset (micro-batch 8 x 2048 tokens, bf16, AdamW)
through :func:`ray_fsdp_backend.trainer.loop.train.run_training`, the loop
``ray-fsdp train`` runs, on one GPU (a world-size-1 NCCL group, no Ray
actors), once eager and once with compiled blocks. For each it records:

- every step's time from CUDA events recorded between steps (nothing is
  synchronised to take them: the loop runs as it does in training);
- NVML every 100 ms (``nvidia-ml-py``, if installed): SM clock, power,
  utilisation, temperature and the clock-throttle reasons;
- a ``torch.profiler`` trace of one late step that does not log, and the
  GPU's idle time between its kernels (the span from the step's first
  kernel to its last, minus the union of kernel and copy intervals).

It reports steps 10-30 and 150-200 separately (time, tokens/s, MFU, and
the NVML record of each window), so a late slowdown shows whether the
clocks fell (power cap) or the GPU waited (idle samples, idle time between
kernels). ``DIR`` gets ``sustained.json`` and ``trace_<mode>.json``
(open in https://ui.perfetto.dev). Without a GPU it says so and exits 0;
``--cpu`` runs it tiny on the CPU with gloo, eager only (the suite's smoke
run: no NVML, no kernels). Needs Ray installed (the training spec is
validated by it), as ``ray-fsdp train`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

EARLY = (10, 30)
MODES = ("eager", "compiled", "dmuon")


class NvmlSampler:
    """A thread reading NVML every ``interval_s`` into ``samples``; inert
    (``available`` False, ``reason`` set) without ``nvidia-ml-py`` or a GPU."""

    def __init__(self, device: torch.device, interval_s: float = 0.1) -> None:
        self.samples: list[dict] = []
        self.interval_s, self.available, self.reason = interval_s, False, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device.type != "cuda":
            self.reason = "not a CUDA device"
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return
        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        self.available = True

    def _read(self) -> dict:
        nv, h = self._nvml, self._handle
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return {
            "t": time.perf_counter(),
            "sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000,
            "util_pct": nv.nvmlDeviceGetUtilizationRates(h).gpu,
            "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "throttle": int(reasons(h)),
        }

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self._read())

    def __enter__(self) -> NvmlSampler:
        if self.available:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def window(self, start: float, end: float) -> dict | None:
        """NVML summary of the samples taken between host times ``start`` and ``end``."""
        rows = [s for s in self.samples if start <= s["t"] <= end]
        if not rows:
            return None
        throttle = 0
        for s in rows:
            throttle |= s["throttle"]
        return {
            "samples": len(rows),
            "sm_mhz_median": statistics.median(s["sm_mhz"] for s in rows),
            "sm_mhz_min": min(s["sm_mhz"] for s in rows),
            "power_w_median": statistics.median(s["power_w"] for s in rows),
            "util_pct_mean": statistics.fmean(s["util_pct"] for s in rows),
            "util_zero_fraction": sum(s["util_pct"] == 0 for s in rows) / len(rows),
            "temp_c_max": max(s["temp_c"] for s in rows),
            "throttle_reasons_any": hex(throttle),
            # 0x4: software power cap (nvmlClocksEventReasonSwPowerCap).
            "power_cap_fraction": sum(bool(s["throttle"] & 0x4) for s in rows) / len(rows),
        }


class StepClock:
    """``on_step`` for :func:`run_training`: a CUDA event (or the host clock on
    CPU) and the host time after every step, and the profiler's step."""

    def __init__(self, device: torch.device, profiler) -> None:
        self.device, self.profiler = device, profiler
        self.events: dict[int, object] = {}
        self.host_t: dict[int, float] = {}

    def __call__(self, step: int) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[step] = event
        else:
            self.events[step] = time.perf_counter()
        self.host_t[step] = time.perf_counter()
        self.profiler.step()

    def step_ms(self) -> dict[int, float]:
        """Milliseconds of every step after the first (synchronises once, at the end)."""
        steps = sorted(self.events)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

        def gap(a, b) -> float:
            return a.elapsed_time(b) if self.device.type == "cuda" else 1e3 * (b - a)

        pairs = zip(steps[:-1], steps[1:], strict=True)
        return {b: gap(self.events[a], self.events[b]) for a, b in pairs}


def idle_between_kernels(prof) -> dict | None:
    """:func:`compute_gpu_idle` over the profiled step's GPU kernels and copies."""
    return compute_gpu_idle(
        [
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
    )


def compute_gpu_idle(intervals: list[tuple[float, float, str]]) -> dict | None:
    """PURE: GPU busy and idle time from (start_us, end_us, kernel name)
    intervals: the span from the first start to the last end, the union of
    the intervals busy, the rest idle, and the five longest gaps with the
    kernel that ended before each. None without intervals."""
    gpu = sorted(intervals)
    if not gpu:
        return None
    busy, gaps = 0.0, []
    cur_start, cur_end, last = gpu[0]
    for start, end, name in gpu[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, last))
            cur_start = start
        if end >= cur_end:
            cur_end, last = end, name
    busy += cur_end - cur_start
    span = cur_end - gpu[0][0]
    top = sorted(gaps, reverse=True)[:5]
    return {
        "kernels": len(gpu),
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "idle_pct_of_span": 100 * (span - busy) / span if span else 0.0,
        "longest_gaps": [{"us": g, "after": name[:80]} for g, name in top],
    }


def build_run_spec(mode: str, args, device: torch.device):
    """The training spec ``ray-fsdp train`` would run for ``mode``."""
    from ray_fsdp_backend.trainer.schema.spec import build_spec

    on_gpu = device.type == "cuda"
    doc = {
        "distributed": {
            "use_fsdp": True,
            "compile": mode == "compiled",
            "use_mixed_precision": on_gpu,  # bf16 on the GPU, fp32 on the CPU
            "use_dmuon": mode == "dmuon",
        },
        "model": {"preset": args.preset},
        "train": {
            "steps": args.steps,
            "micro_batch_size": args.batch,
            "log_every": args.log_every,
            "warmup_steps": 10,
            "optimizer": "muon" if mode == "dmuon" else "adamw",
            "lr": 0.02 if mode == "dmuon" else 3e-4,
        },
        "scaling": {"num_workers": 1, "use_gpu": on_gpu},
    }
    return build_spec(doc)


def windows(steps: int) -> dict[str, tuple[int, int]]:
    """Steps 10-30 and the last quarter (150-200 of 200), clamped to the run."""
    late = (max(min(EARLY[1], steps), steps * 3 // 4), steps)
    return {"early": (min(EARLY[0], steps), min(EARLY[1], steps)), "late": late}


def profiled_step(steps: int, log_every: int) -> int:
    """A late step that does not log."""
    step = max(3, steps - 15)
    return step - 1 if step % log_every == 0 else step


def summarize(step_ms, clock, nvml, window, logged, tokens_per_step, flops, peak) -> dict:
    a, b = window
    times = [ms for s, ms in step_ms.items() if a <= s <= b]
    quiet = [ms for s, ms in step_ms.items() if a <= s <= b and s not in logged]
    mean_s = statistics.fmean(times) / 1e3 if times else float("nan")
    tokens_per_s = tokens_per_step / mean_s
    out = {
        "steps": [a, b],
        "step_ms_median": statistics.median(times) if times else None,
        "step_ms_mean": 1e3 * mean_s,
        "step_ms_max": max(times, default=None),
        "non_logging_step_ms_median": statistics.median(quiet) if quiet else None,
        "tokens_per_s": tokens_per_s,
        "mfu_pct": 100 * flops * tokens_per_s / peak if peak else None,
    }
    if nvml.available and a in clock.host_t and b in clock.host_t:
        out["nvml"] = nvml.window(clock.host_t[a], clock.host_t[b])
    return out


def run_mode(mode: str, args, device: torch.device, out: Path) -> dict:
    from ray_fsdp_backend.metrics.flops import compute_dtype, resolve_peak_flops
    from ray_fsdp_backend.runtime.context import set_context
    from ray_fsdp_backend.runtime.worker import setup_process_context
    from ray_fsdp_backend.trainer.loop.train import is_logged, run_training

    spec = build_run_spec(mode, args, device)
    ctx = setup_process_context(spec.distributed, device)
    target = profiled_step(args.steps, args.log_every)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profile: dict = {"step": target}

    def trace_ready(prof) -> None:
        trace = out / f"trace_{mode}.json"
        prof.export_chrome_trace(str(trace))
        profile.update(trace=trace.name, idle=idle_between_kernels(prof))

    # Intervals between profiler steps: the first holds setup and step 1.
    schedule = torch.profiler.schedule(skip_first=target - 2, wait=0, warmup=1, active=1, repeat=1)
    prof = torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=trace_ready
    )
    clock = StepClock(device, prof)
    started = time.perf_counter()
    with NvmlSampler(device) as nvml, prof:
        history = run_training(ctx, spec, report=lambda metrics: None, on_step=clock, resume=False)
    wall_s = time.perf_counter() - started
    # The profiler's warm-up, profiled and trace-writing steps are not timed.
    profiled = {target - 1, target, target + 1}
    step_ms = {s: ms for s, ms in clock.step_ms().items() if s not in profiled}
    logged = {s for s in step_ms if is_logged(s, 0, spec.train)}
    cfg = ctx.config
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = resolve_peak_flops(name, compute_dtype(cfg.use_mixed_precision, cfg.bf16), None)
    tokens = spec.train.micro_batch_size * spec.model.seq_len
    flops = spec.model.flops_per_token()
    result = {
        "mode": mode,
        "compile": cfg.compiles_on(device.type),
        "wall_s": wall_s,
        "first_logged_step_s": history[0]["step_time_s"],
        "windows": {
            key: summarize(step_ms, clock, nvml, span, logged, tokens, flops, peak)
            for key, span in windows(args.steps).items()
        },
        "profile": profile,
        "nvml": {"available": nvml.available, "reason": nvml.reason, "samples": nvml.samples},
        "step_ms": step_ms,
        "skipped_steps": history[-1]["skipped_steps"],
    }
    early, late = (result["windows"][k]["step_ms_mean"] for k in ("early", "late"))
    result["late_over_early"] = late / early
    set_context(None)
    del ctx, history
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def format_table(results: list[dict]) -> str:
    lines = ["| mode | steps | ms/step (median) | tok/s | MFU % | idle between kernels |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        idle, step = r["profile"].get("idle"), r["profile"]["step"]
        idle_text = f"{idle['idle_pct_of_span']:.1f}% of step {step}" if idle else "-"
        for w in r["windows"].values():
            mfu = f"{w['mfu_pct']:.1f}" if w["mfu_pct"] is not None else "-"
            lines.append(
                f"| {r['mode']} | {w['steps'][0]}-{w['steps'][1]} | {w['step_ms_median']:.1f} | "
                f"{w['tokens_per_s']:,.0f} | {mfu} | {idle_text} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    from benchmarks._device import init_single_rank, pick_device

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("sustained_out"), help="a directory")
    parser.add_argument("--cpu", action="store_true", help="tiny, on the CPU (smoke run)")
    parser.add_argument("--preset", default=None, help="model preset (1b; tiny with --cpu)")
    parser.add_argument("--steps", type=int, default=None, help="steps per mode (200; 40)")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch (8; 2 with --cpu)")
    parser.add_argument("--log-every", type=int, default=10, help="as train.log_every")
    parser.add_argument("--modes", default=None, help=f"comma list of {', '.join(MODES)}")
    args = parser.parse_args(argv)
    device = pick_device(args.cpu, "benchmarks.gpu --sustained")
    if device is None:
        return None
    small = device.type == "cpu"
    args.preset = args.preset or ("tiny" if small else "1b")
    args.steps = args.steps or (40 if small else 200)
    args.batch = args.batch or (2 if small else 8)
    modes = (args.modes or ("eager" if small else "eager,compiled")).split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: {unknown} not in {', '.join(MODES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    init_single_rank(device)
    try:
        results = [run_mode(mode, args, device, args.out) for mode in modes]
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "device": device_name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "micro_batch": args.batch,
        "steps": args.steps,
        "results": results,
    }
    (args.out / "sustained.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"{device_name}, preset {args.preset}, micro-batch {args.batch}, {args.steps} steps")
    print(format_table(results))
    return report
