"""Checkpoints in real TorchTrainer runs: exact resume after killed workers,
the async-registration race, a crash during save, resharding into another
run with another strategy and world size, export, and a hanging rank.

Every run is its own reference: a killed group computed steps past its
last checkpoint, and the group after it must compute them again bit for bit
(tests/dist/test_checkpoint.py holds resume and reshard against separate
uninterrupted runs, no Ray). Two fits share one Ray session: the job with
two injected faults (3 worker groups), and a new run that resumes its final
checkpoint under DDP with 3 workers and then hangs one rank. Two more in
the same session, one fit each: LoRA and QLoRA adapters on a tiny
pretrained Llama, a worker killed one step past a checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import PurePath

import pytest
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from safetensors.torch import load_file

import ray_fsdp_backend as rfb
from ray_fsdp_backend.checkpoint import CheckpointStore
from tests.e2e.ckpt_fns import restore_then_hang, train_resumable
from tests.models import ToyNet, make_batch

pytestmark = pytest.mark.e2e

STEPS, EVERY = 8, 2
FSDP = rfb.FSDPConfig(use_fsdp=True, use_mixed_precision=False)
FAULTS = [
    # Killed right after the step-4 report returned, between the checkpoints of
    # steps 4 and 6; Ray may not have registered step 4 yet.
    {"rank": 1, "step": 4, "where": "after_save"},
    # Rank 0 dies in the step-8 save after every shard was written, before the
    # marker: the group before it computed steps 7 and 8 past the step-6
    # checkpoint, the reference of the group after it.
    {"rank": 0, "step": 8, "where": "during_save"},
]


def _fit(tmp_path, name: str, faults: list, steps: int = STEPS, **config):
    fault_dir = tmp_path / f"{name}_faults"
    fault_dir.mkdir()
    trainer = TorchTrainer(
        train_resumable,
        train_loop_config={
            "steps": steps,
            "every": EVERY,
            "fault_dir": str(fault_dir),
            "faults": faults,
            **config,
        },
        torch_config=FSDP,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path / "storage"),
            # One restart to spare: Ray 2.60's placement-group cleaner can
            # remove a healthy group on a loaded machine; resume is exact anyway.
            failure_config=FailureConfig(max_failures=len(faults) + 1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    attempts = sorted(fault_dir.glob("attempt_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    fired = [int((fault_dir / f"fired_{i}").read_text()) for i in range(len(faults))]
    return result, [json.loads(p.read_text()) for p in attempts], fired


@pytest.fixture(scope="module")
def runs(ray_local, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ckpt_e2e")
    export = str(tmp_path / "export" / "model.safetensors")
    faulted = _fit(tmp_path, "faulted", FAULTS, export=export, params_at=STEPS)
    return tmp_path, faulted, export


def test_resume_after_killed_workers_equals_the_uninterrupted_group(runs):
    _, (faulted, attempts, fired), _ = runs
    # The attempt after the kill right after the step-4 report resumes from
    # step 4, although Ray may hand it step 2 or nothing (async registration);
    # the one after the crash in the step-8 save skips that partial checkpoint.
    assert [attempts[a + 1]["resumed_from"] for a in fired] == [4, 6]
    print("Ray handed, per attempt:", [a["handed"] for a in attempts])
    # Steps 7 and 8: the group the crash ended ran them uninterrupted from
    # step 4; the resumed group from the step-6 checkpoint.
    before, after = attempts[fired[1]], attempts[fired[1] + 1]
    assert {"7", "8"} <= set(before["losses"]) & set(after["losses"]), attempts
    seen: dict[str, float] = {}
    for attempt in attempts:  # a step any two attempts computed: bit for bit
        for step, loss in attempt["losses"].items():
            assert seen.setdefault(step, loss) == loss, (attempt, step)
    assert sorted(seen, key=int) == [str(s) for s in range(1, STEPS + 1)]
    for name, value in before["params_at"].items():
        assert torch.equal(torch.tensor(faulted.return_value["params"][name]), torch.tensor(value))
        assert torch.equal(torch.tensor(after["params_at"][name]), torch.tensor(value))
    assert faulted.metrics["step"] == STEPS
    # The partial step-8 checkpoint was deleted by the next commit.
    markers = CheckpointStore.local(PurePath(faulted.checkpoint.path).parent).read_markers()
    print("checkpoints in storage:", sorted(markers))
    assert all(markers.values()), markers


def test_export_loads_into_plain_model(runs):
    _, (faulted, _, _), export = runs
    plain = ToyNet()
    plain.load_state_dict(load_file(export), strict=True)
    for name, value in faulted.return_value["params"].items():
        assert torch.equal(plain.state_dict()[name], torch.tensor(value)), name
    x = make_batch(4)[0]
    assert plain(x).shape == (4, 8)


def test_new_run_reshards_to_ddp_and_a_hanging_rank_fails_within_timeout(runs):
    tmp_path, (faulted, _, _), _ = runs
    restored = tmp_path / "restored.json"
    timeout_s, sleep_s = 10, 120
    trainer = TorchTrainer(
        restore_then_hang,
        train_loop_config={
            "restored": str(restored),
            "sleep_s": sleep_s,
            "checkpoint": faulted.checkpoint,
        },
        torch_config=rfb.FSDPConfig(use_fsdp=False, timeout_s=timeout_s),
        scaling_config=ScalingConfig(num_workers=3),
        run_config=RunConfig(
            name="resharded",
            storage_path=str(tmp_path / "storage"),
            failure_config=FailureConfig(max_failures=0),
        ),
    )
    with pytest.raises(Exception) as info:
        trainer.fit()
    ended = time.time()
    got = json.loads(restored.read_text())
    assert got["strategy"] == "DDPStrategy" and got["world_size"] == 3
    assert got["extra"] == {"step": STEPS}
    for name, value in faulted.return_value["params"].items():
        assert torch.equal(torch.tensor(got["params"][name]), torch.tensor(value)), name
    hang_s = ended - got["time"]
    print(f"hang to failed fit: {hang_s:.1f} s (timeout_s={timeout_s})")
    assert hang_s < timeout_s + 30, (hang_s, info.value)


# The LoRA and QLoRA runs are their own reference: rank 1 dies at the start of
# step 4, after the uninterrupted group computed step 3 past the step-2
# checkpoint; the restarted group resumes from step 2 and must compute step 3's
# loss and parameters again bit for bit (tests/dist/test_lora.py and
# test_qlora.py hold the resume against a separate uninterrupted run, no Ray).
KILL_AFTER_STEP_3 = [{"rank": 1, "step": 4, "where": "mid_step"}]


def _check_resumed_step_3(attempts: list[dict], fired: list[int]) -> dict:
    """The attempt the kill ended and the one after it agree on step 3's loss
    and parameters; returns those parameters."""
    before, after = attempts[fired[0]], attempts[fired[0] + 1]
    assert after["resumed_from"] == 2, attempts
    assert {"1", "2", "3"} <= set(before["losses"]) and {"3", "4"} <= set(after["losses"])
    reference = {**after["losses"], **before["losses"]}  # step 4: the resumed group's
    for attempt in attempts:  # every loss any attempt computed, bit for bit
        for step, loss in attempt["losses"].items():
            assert loss == reference[step], (attempt, step)
    want, got = before["params_at"], after["params_at"]
    assert sorted(got) == sorted(want) and all(".lora_" in k for k in want), sorted(want)
    for name, value in want.items():
        assert torch.equal(torch.tensor(got[name]), torch.tensor(value)), name
    return want


def test_lora_resume_after_killed_worker_equals_uninterrupted_run(ray_local, tmp_path):
    """LoRA on the frozen tiny Llama (FSDP2, 2 workers): rank 1 dies after
    step 3, past the step-2 checkpoint; the restarted group restores the
    adapters, their AdamW state and the dropout RNG from the adapters-only
    checkpoint and on the reloaded base computes the uninterrupted group's
    step-3 loss and adapters, bit for bit."""
    pytest.importorskip("peft")
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    pretrained = save_tiny_pretrained("llama", tmp_path / "pretrained")
    config = dict(pretrained=pretrained, params_at=3)
    _, attempts, fired = _fit(tmp_path, "lora", KILL_AFTER_STEP_3, 4, **config)
    params = _check_resumed_step_3(attempts, fired)
    assert len(params) == 4 * 2  # q_proj, v_proj x lora_A, lora_B x 2 blocks


def test_qlora_resume_after_killed_worker_equals_uninterrupted_run(ray_local, tmp_path):
    """QLoRA (the tiny Llama's base in NF4, each worker quantising its shard;
    FSDP2, 2 workers): rank 1 dies after step 3, past the step-2 checkpoint;
    the restarted group re-quantises the base, restores the adapters and
    their AdamW state, and computes the uninterrupted group's step-3 loss and
    adapters bit for bit."""
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    pretrained = save_tiny_pretrained("llama_qlora", tmp_path / "pretrained", max_shard_size="2MB")
    lora = {"r": 8, "base_quantization": "nf4"}
    config = dict(pretrained=pretrained, lora=lora, params_at=3)
    _, attempts, fired = _fit(tmp_path, "qlora", KILL_AFTER_STEP_3, 4, **config)
    _check_resumed_step_3(attempts, fired)
