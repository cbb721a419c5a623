"""Smoke run of the benchmarks at their smallest sizes, so that they never rot.

No timing is asserted (timings belong in the benchmark's output); what is
checked is what must hold whatever the machine's speed: both sides of every
comparison do the same work, the clip's collective count does not grow with
the number of tensors, memory follows the sharding.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu, run

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def results(tmp_path_factory, ray_local):
    """The quick run, its start-up comparison on this worker's shared cluster."""
    out = run.main(["--quick", "--out", str(tmp_path_factory.mktemp("bench"))])
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_every_comparison_is_reported(results):
    data, md = results
    assert set(run.COMPARISONS) <= set(data)
    for heading in ("1. Step time", "2. Memory", "3. Clipping", "4. Start-up", "5. DMuon",
                    "6. Scaling", "7. `compile: true`", "8. Loading a pretrained",
                    "9. Checkpoints", "10. LoRA", "11. Tensor parallel"):  # fmt: skip
        assert f"#### {heading}" in md
    assert data["machine"]["torch"] == torch.__version__


def test_step_time_sides_do_the_same_work(results):
    data, _ = results
    for world in data["step_time"]:
        for row in world["strategies"]:
            assert row["same_loss"], row["strategy"]
            assert row["time"]["reps"] == data["settings"]["step_time"]["reps"]
            memory = row["memory"]
            assert memory["ours"] == memory["hand"], row["strategy"]
            if row["strategy"] != "hybrid_shard":  # 2 ranks: replicate 2 x shard 1
                assert memory["vs_ideal"] == pytest.approx(1.0, rel=0.05)
            assert memory["plan_estimate"] == pytest.approx(memory["total_per_rank"], rel=0.1)


def test_clip_collectives_do_not_grow_with_tensors(results):
    data, _ = results
    for world in data["clipping"]:
        counts = {row["ours_collectives"] for row in world["rows"]}
        assert counts == {1}
        assert all(r["ours_reported_collectives"] == 1 for r in world["rows"])
        # torch's clip issues its all-reduce inside DTensor's dispatch: the
        # counter must see collectives issued there too (it counted 0 once).
        assert all(r["torch_collectives"] >= 1 for r in world["rows"])
        assert world["mixed_sharded_and_plain"]["ours"].startswith("ok")


def test_startup_and_dmuon_and_scaling_measured(results):
    data, _ = results
    assert data["startup"]["ours_s"] > 0 and data["startup"]["ray_torch_config_s"] > 0
    for size in data["dmuon"]["results"]:
        for ranks, row in size["dmuon"].items():
            # Every matrix orthogonalised exactly once across the ranks.
            assert sum(row["ns_matrices_per_rank"]) == size["num_matrices"]
            total = size["momentum_bytes_single_process"]
            assert max(row["momentum_bytes_per_rank"]) <= total / int(ranks) * 1.5
    for series in data["scaling"]["series"].values():
        for row in series:
            assert row["memory_ratio"] == pytest.approx(row["params_ratio"], rel=0.05)


def test_compiled_and_eager_blocks_do_the_same_work(results):
    data, _ = results
    assert data["compile"]["same_loss"] and data["compile"]["compile_s"] > 0


def test_gpu_benchmark_runs_on_cpu_and_skips_without_gpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--cpu", "--preset", "tiny", "--batch", "1",
           "--steps", "1", "--reps", "1", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    data = json.loads(out.read_text())
    assert data["process_group"]["all_reduce_ok"]
    assert data["throughput"]["ours"]["tokens_per_s"] > 0
    assert {tuple(r["shape"][1:]) for r in data["newton_schulz_bf16"]} == {
        (128, 128), (384, 128), (128, 384)
    }  # fmt: skip
    assert data["offload_hsdp_dmuon"]["finite"]
    if not torch.cuda.is_available():  # in this process: the skip starts nothing
        assert gpu.main([]) is None
        assert "skipped, no CUDA GPU" in capsys.readouterr().out


def test_lora_trains_and_stores_less_than_full_fine_tuning(results):
    data, _ = results
    for row in data["lora"]["rows"]:
        full, r8, r64 = row["full"], row["lora_r8"], row["lora_r64"]
        # Gradients and optimizer state follow the trainable parameters (r 64 on
        # the quick run's 64-wide model is almost as large as the model itself).
        for key in ("grads", "optimizer"):
            assert r8["state"][key] < r64["state"][key] < full["state"][key], key
        assert r8["state"]["grads"] < full["state"]["grads"] / 4
        assert r8["checkpoint_bytes"] < r64["checkpoint_bytes"] < full["checkpoint_bytes"]
        assert r8["state"]["params"] > full["state"]["params"]  # the base plus the adapters
        # QLoRA: the NF4 weights (codes and scales as stored) at most 0.3x the same
        # weights in bf16 (0.258x), a smaller base than LoRA's, the adapters' state as LoRA's.
        q8 = row["qlora_r8"]
        assert 0 < q8["nf4_bytes_per_rank"] <= 0.3 * 2 * q8["nf4_params_per_rank"], q8
        assert q8["base_bytes_per_rank"] < r8["base_bytes_per_rank"], (q8, r8)
        for key in ("grads", "optimizer"):
            assert q8["state"][key] == r8["state"][key], key


def test_sustained_benchmark_runs_the_training_loop_on_cpu(tmp_path, capsys):
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--sustained", "--cpu", "--steps", "34",
           "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    data = json.loads((tmp_path / "sustained.json").read_text())
    (eager,) = data["results"]
    assert eager["mode"] == "eager" and not eager["compile"]  # compile: auto is off on CPU
    assert eager["skipped_steps"] == 0
    for window in eager["windows"].values():
        assert window["tokens_per_s"] > 0 and window["non_logging_step_ms_median"] > 0
    profiled = eager["profile"]["step"]
    assert profiled % 10 and (tmp_path / eager["profile"]["trace"]).stat().st_size > 0
    timed = {int(s) for s in eager["step_ms"]}
    assert timed == set(range(2, 35)) - {profiled - 1, profiled, profiled + 1}
    assert not eager["nvml"]["available"] and eager["nvml"]["reason"]
    if not torch.cuda.is_available():
        assert gpu.main(["--sustained"]) is None
        assert "skipped, no CUDA GPU" in capsys.readouterr().out


def test_tensor_parallel_and_fsdp_train_the_same_global_batch(results):
    data, _ = results
    tp = data["tensor_parallel"]
    assert tp["same_loss"]
    # tp 2 x dp_shard 2 and dp_shard 4 both hold a quarter of the model per rank.
    params = {name: mem["params"] for name, mem in tp["memory"].items()}
    assert params["tp2_dp2"] == pytest.approx(params["dp4"], rel=0.05)


def test_upload_stream_smoke():
    """``benchmarks.upload_stream`` at 16 MiB (its default is 1 GiB, run by
    hand): both modes upload every byte, and the streamed one (the layer
    now) puts nothing on local disk (the spooled one, the layer before issue
    34, does above 16 MiB)."""
    from benchmarks import upload_stream

    result = upload_stream.main(["--mib", "16", "--reps", "1"])
    for row in result["modes"].values():
        assert row["bytes"] == 16 * 1024 * 1024
    assert result["modes"]["streamed"]["spool_file_mib"] == 0
