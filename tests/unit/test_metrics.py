"""Step metrics: FLOPs per token against a hand count, peaks, MFU, the
progress line, the meter in one process, and the Ray report-line switch."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from torch import nn

from ray_fsdp_backend.metrics.flops import (
    compute_dtype,
    flops_per_token,
    format_progress,
    resolve_peak_flops,
    throughput_metrics,
)
from ray_fsdp_backend.metrics.reporting import (
    StepMeter,
    estimate_flops_per_token,
    show_ray_report_lines,
)
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.storage.retry import STATS as STORAGE_RETRIES
from ray_fsdp_backend.strategies.blocks import apply_compile, find_blocks

TINY = ModelConfig(dim=128, n_layers=4, n_heads=4, seq_len=128)


def test_flops_per_token_of_the_tiny_model_by_hand():
    # One block: wq, wk, wv, wo 4 x 128 x 128; SwiGLU hidden 64 * ceil(8 * 128 / 3 / 64)
    # = 384: w1, w3, w2 3 x 128 x 384; two norms 2 x 128.
    block = 4 * 128 * 128 + 3 * 128 * 384 + 2 * 128
    assert block == 213_248
    # The embedding is the tied output head (a matmul, so it counts), plus the final norm.
    n = 4 * block + 256 * 128 + 128
    assert n == 885_888
    attention = 12 * 4 * 128 * 128  # 12 x layers x (heads x head_dim) x seq_len
    expected = 6 * n + attention
    assert expected == 6_101_760
    assert flops_per_token(n, n_layers=4, attn_width=128, seq_len=128) == expected
    with torch.device("meta"):
        model = Transformer(TINY)
    assert estimate_flops_per_token(model, seq_len=128) == expected


def test_blocks_are_counted_by_class_name_also_after_wrapping():
    from ray_fsdp_backend.metrics.reporting import count_blocks
    from ray_fsdp_backend.models.decoder import Block

    with torch.device("meta"):
        model = Transformer(TINY)
    assert count_blocks(model) == count_blocks(model, ("Block",)) == 4
    # fully_shard swaps each block's class for a subclass named FSDPBlock.
    wrapped = type("FSDPBlock", (Block,), {})
    for block in model.layers:
        block.__class__ = wrapped
    assert count_blocks(model, ("Block",)) == 4


def test_an_untied_input_embedding_is_not_a_matmul():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, seq_len=32, tie_embeddings=False)
    with torch.device("meta"):
        model = Transformer(cfg)
    n = cfg.num_params() - 256 * 64  # all but the input embedding; the head stays
    assert estimate_flops_per_token(model, seq_len=32) == 6 * n + 12 * 2 * 64 * 32


def test_peak_flops_table_override_and_unknown_devices():
    assert resolve_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert resolve_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert resolve_peak_flops("NVIDIA H200", "fp32") == 67e12
    assert resolve_peak_flops("NVIDIA L40S", "bf16") == 362e12  # not the L4's
    assert resolve_peak_flops("NVIDIA L4", "bf16") == 121e12
    assert resolve_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on V100
    assert resolve_peak_flops("cpu", "fp32") is None
    assert resolve_peak_flops("cpu", "fp32", override_tflops=2.5) == 2.5e12
    with pytest.raises(ValueError, match="dtype='int8' is not one of bf16, fp16, fp32"):
        resolve_peak_flops("NVIDIA H100", "int8")
    assert compute_dtype(False, True) == "fp32"
    assert compute_dtype(True, True) == "bf16" and compute_dtype(True, False) == "fp16"


def test_throughput_and_mfu_by_hand():
    # 4 steps, 4096 tokens over 2 ranks in 2 s; 1 MFLOP per token; 1 TFLOP/s peak.
    m = throughput_metrics(
        tokens=4096, seconds=2.0, steps=4, world_size=2, flops_per_token=1e6, peak_flops=1e12
    )
    assert m["tokens_per_s"] == 2048 and m["tokens_per_s_per_rank"] == 1024
    assert m["step_time_s"] == 0.5
    assert m["tflops_per_rank"] == pytest.approx(1024 * 1e6 / 1e12)
    assert m["mfu_pct"] == pytest.approx(100 * 1024 * 1e6 / 1e12)
    no_peak = throughput_metrics(
        tokens=1, seconds=1.0, steps=1, world_size=1, flops_per_token=1e6, peak_flops=None
    )
    assert "tflops_per_rank" in no_peak and "mfu_pct" not in no_peak


def test_progress_line():
    m = {
        "step": 7, "loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 12345.6,
        "tokens_per_s_per_rank": 6172.8, "mfu_pct": 41.23, "step_time_s": 0.1234,
        "memory_peak_reserved_gib": 1.5, "eta_s": 75.0,
    }  # fmt: skip
    assert format_progress(m, total_steps=100) == (
        "step   7/100 | loss 2.5000 | grad norm 0.500 | lr 1.00e-03 | "
        "12,346 tok/s (6,173/rank) | MFU 41.2% | 123 ms/step | mem 1.50 GiB | ETA 00:01:15"
    )
    del m["mfu_pct"]
    assert "MFU" not in format_progress(m, total_steps=100)


def test_progress_line_of_a_preference_objective():
    m = {
        "step": 7, "loss": 0.5, "eval_loss": 0.6, "rewards/margins": 1.25,
        "rewards/accuracies": 0.875, "eval/rewards/margins": 0.5, "eval/rewards/accuracies": 0.75,
        "tokens_per_s": 1.0, "tokens_per_s_per_rank": 1.0, "step_time_s": 0.1, "eta_s": 1.0,
    }  # fmt: skip
    assert format_progress(m, total_steps=10).startswith(
        "step  7/10 | loss 0.5000 | eval loss 0.6000 | margin 1.250 acc 0.88 | "
        "eval margin 0.500 acc 0.75 | "
    )


def test_step_meter_in_one_process():
    meter = StepMeter(
        device=torch.device("cpu"), flops_per_token=100.0, peak_flops=1e6, total_steps=10,
        start_step=2, start_tokens=64,
    )  # fmt: skip
    for _ in range(3):
        meter.count_tokens(32)
    m = meter.measure(5)
    assert m["tokens_seen"] == 64 + 96
    assert m["tokens_per_s"] > 0 and m["mfu_pct"] > 0
    assert m["eta_s"] == pytest.approx(m["step_time_s"] * 5)  # 5 steps left at this pace
    assert m["memory_peak_allocated_gib"] > 0.01  # this process's peak RSS
    retries, seconds = STORAGE_RETRIES.snapshot()
    assert (m["storage_retries"], m["storage_retry_s"]) == (retries, seconds)
    meter.count_tokens(32)
    loss, norm = torch.tensor(2.5), torch.tensor(0.75)
    m = meter.measure(6, mean={"loss": loss}, same={"grad_norm": norm, "skipped_steps": 3.0})
    assert m["tokens_seen"] == 64 + 128
    assert (m["loss"], m["grad_norm"], m["skipped_steps"]) == (2.5, 0.75, 3.0)


def test_ray_report_lines_are_hidden_and_shown_again():
    from ray.train.v2._internal.execution import context as ray_context

    # Ray 2.60 logs the line through a logger named by its file path: the one switched.
    source = inspect.getsource(ray_context)
    assert "logger = logging.getLogger(__file__)" in source
    assert 'f"Reporting training result {report_call_index}' in source
    logger = logging.getLogger(ray_context.__file__)
    try:
        show_ray_report_lines(False)
        assert not logger.isEnabledFor(logging.INFO)
        assert logger.isEnabledFor(logging.WARNING)
        show_ray_report_lines(True)
        logging.getLogger().setLevel(logging.INFO)  # as Ray configures a worker's root
        assert logger.isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(logging.NOTSET)


def test_compile_and_peak_settings_are_validated():
    assert FSDPSettings(compile=True, peak_tflops=312).peak_tflops == 312
    with pytest.raises(ValueError, match="compile='yes' is not one of auto, True, False"):
        FSDPSettings(compile="yes")
    with pytest.raises(ValueError, match="compile=1 has type int; expected bool or str"):
        FSDPSettings(compile=1)
    with pytest.raises(ValueError, match="peak_tflops=0 must be positive or null"):
        FSDPSettings(peak_tflops=0)


def test_compile_auto_is_on_for_cuda_workers_only():
    auto = FSDPSettings()
    assert auto.compile == "auto" and auto.compiles_on("cuda") and not auto.compiles_on("cpu")
    assert FSDPSettings(compile=True).compiles_on("cpu")
    assert not FSDPSettings(compile=False).compiles_on("cuda")
    assert FSDPSettings.from_dict(auto.to_dict()).compile == "auto"


def test_compile_without_blocks_names_the_fix(caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(ValueError, match="compile=True but the wrap policy found no blocks"):
        apply_compile(model, find_blocks(model))
    apply_compile(model, find_blocks(model), required=False)  # compile: auto
    assert "compile: auto runs eagerly" in caplog.text
    with torch.device("meta"):
        transformer = Transformer(TINY)
    apply_compile(transformer, find_blocks(transformer))  # lazy: nothing compiles yet
    assert all(b._compiled_call_impl is not None for b in transformer.layers)
    assert [n for n, _ in transformer.named_parameters()] == [
        n for n, _ in Transformer(TINY).named_parameters()
    ]  # names unchanged: checkpoints load either way


def test_cli_verbose_flag_and_tensorboard_dir(tmp_path, monkeypatch):
    from ray_fsdp_backend.cli import main as cli

    args = cli.build_parser().parse_args(["train", "examples/cpu_tiny.yaml", "-v"])
    assert args.verbose
    monkeypatch.chdir(tmp_path)
    doc = cli.absolute_tensorboard_dir({"logging": {"tensorboard": "tb"}})
    assert doc["logging"]["tensorboard"] == str(tmp_path / "tb")
    uri = {"logging": {"tensorboard": "s3://bucket/tb"}}
    assert cli.absolute_tensorboard_dir(uri) == uri
    assert cli.absolute_tensorboard_dir({}) == {}


def test_l40_is_not_an_l4_and_eta_counts_days():
    from ray_fsdp_backend.metrics.flops import format_eta, resolve_peak_flops

    assert resolve_peak_flops("NVIDIA L40", "bf16") == 181.0e12
    assert resolve_peak_flops("NVIDIA L4", "bf16") == 121.0e12
    assert resolve_peak_flops("NVIDIA L40S", "bf16") == 362.0e12
    assert format_eta(100000) == "1d 03:46:40"
    assert format_eta(59) == "00:00:59"
