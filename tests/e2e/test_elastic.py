"""Elastic training on a fake 2-node cluster (``ray.cluster_utils.Cluster``).

One elastic run of the example training loop (``num_workers=(2, 4)``,
checkpoint every step, fixed global batch): a node is removed mid-run (the
run continues at 2 workers from the newest checkpoint), a node is added (it
grows back to 4), and it finishes all steps. Then one fixed-size run at 4
workers with the same global batch and data order is the reference: final
parameters agree to fp32 tolerance, and the window starts read over the
elastic run's surviving trajectory are exactly the first ``steps * global``
windows of the epoch, each once. A few minutes.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import ray_fsdp_backend as rfb
from ray_fsdp_backend.trainer.data import WindowOrder, load_corpus
from tests.e2e.elastic_fns import train_recording

pytestmark = pytest.mark.e2e

STEPS, GLOBAL, MICRO, SEQ = 12, 8, 2, 32
CONFIG = {
    # HSDP: at 4 workers a (2, 2) mesh over both nodes, at 2 a (1, 2) mesh on the node left.
    "distributed": {
        "use_fsdp": True,
        "fsdp_sharding_strategy": "hybrid_shard",
        "use_mixed_precision": False,
    },
    "model": {"dim": 32, "n_layers": 2, "n_heads": 2, "seq_len": SEQ},
    "train": {
        "steps": STEPS,
        "micro_batch_size": MICRO,
        "global_batch_size": GLOBAL,
        "lr": 3e-3,
        "warmup_steps": 2,
        "log_every": 1,
        "checkpoint_every": 1,
    },
}


def _fit(workers, record_dir: Path, storage: Path, name: str, **record) -> dict:
    record = {"dir": str(record_dir), "global_batch_size": GLOBAL, **record}
    record_dir.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        train_recording,
        train_loop_config={**CONFIG, "_record": record},
        torch_config=rfb.FSDPConfig(**CONFIG["distributed"]),
        scaling_config=ScalingConfig(num_workers=workers, elastic_resize_monitor_interval_s=2.0),
        run_config=RunConfig(
            name=name, storage_path=str(storage), failure_config=FailureConfig(max_failures=3)
        ),
    )
    return trainer.fit().return_value


def read_records(record_dir: Path) -> list[list[dict]]:
    """Every attempt's micro-batch records (all its ranks), attempts in start order."""
    by_pid: dict[str, list[dict]] = defaultdict(list)
    for path in record_dir.glob("rank*_pid*.jsonl"):
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        by_pid[path.stem.split("_")[1]] += lines
    attempts: dict[tuple, list[dict]] = defaultdict(list)
    for lines in by_pid.values():  # the ranks of one attempt start at one position
        first = min(lines, key=lambda r: r["t"])
        attempts[(first["ws"], first["position"])] += lines
    return sorted(attempts.values(), key=lambda rs: min(r["t"] for r in rs))


def steps_done(record_dir: Path, world_size: int) -> int:
    """Global optimizer steps read by attempts at ``world_size`` ranks."""
    rows = [r for a in read_records(record_dir) for r in a if r["ws"] == world_size]
    return len({r["position"] // GLOBAL for r in rows})


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def surviving_trajectory(attempts: list[list[dict]]) -> dict[int, list[int]]:
    """Window starts read per step by the attempt whose result the run kept:
    a later attempt replaces the steps it redid after resuming."""
    steps: dict[int, list[int]] = {}
    for attempt in attempts:
        redo: dict[int, list[int]] = defaultdict(list)
        for r in attempt:
            redo[r["position"] // GLOBAL + 1] += r["starts"]
        steps.update(redo)
    return steps


def test_elastic_run_shrinks_grows_and_matches_a_fixed_size_run(tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        elastic_dir, result = tmp_path / "elastic", {}
        elastic_dir.mkdir()
        (elastic_dir / "hold").touch()
        run = threading.Thread(
            target=lambda: result.update(
                out=_fit(
                    (2, 4), elastic_dir, tmp_path / "runs", "elastic",
                    pace_s=0.3, hold_at_world_size=2, hold_after_steps=2,
                )
            ),
            daemon=True,
        )  # fmt: skip
        started = time.time()
        run.start()
        wait_for(lambda: steps_done(elastic_dir, 4) >= 3, 240, "3 steps at 4 workers")
        cluster.remove_node(nodes[1])
        wait_for(lambda: steps_done(elastic_dir, 2) >= 2, 240, "2 steps at 2 workers")
        cluster.add_node(num_cpus=2)
        grown = lambda: len([a for a in read_records(elastic_dir) if a[0]["ws"] == 4]) >= 2  # noqa: E731
        wait_for(grown, 240, "the group to grow back to 4 workers")
        (elastic_dir / "hold").unlink()
        run.join(timeout=300)
        elastic_s = time.time() - started
        assert "out" in result, "the elastic run did not finish"

        fixed = _fit(4, tmp_path / "fixed", tmp_path / "runs", "fixed")
    finally:
        ray.shutdown()
        cluster.shutdown()

    attempts = read_records(elastic_dir)
    sizes = [a[0]["ws"] for a in attempts]
    resumes = [min(r["position"] for r in a) // GLOBAL for a in attempts]
    print(f"elastic run {elastic_s:.0f} s; attempts (world size, resume step): "
          f"{list(zip(sizes, resumes, strict=True))}")  # fmt: skip
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4
    meshes = {a[0]["ws"]: a[0]["mesh"] for a in attempts}
    assert meshes == {4: [2, 2], 2: [1, 2]}  # HSDP rebuilt from the nodes there are
    assert resumes[0] == 0 and all(0 < r < STEPS for r in resumes[1:])
    assert resumes == sorted(resumes)  # each restart resumed from a newer checkpoint

    history = result["out"]["history"]
    assert history[-1]["step"] == STEPS and history[-1]["world_size"] == 4
    assert history[0]["step"] == resumes[-1] + 1  # the last attempt continued, not restarted

    trajectory = surviving_trajectory(attempts)
    assert sorted(trajectory) == list(range(1, STEPS + 1))
    read = [s for step in sorted(trajectory) for s in trajectory[step]]
    order = WindowOrder(len(load_corpus()), SEQ, seed=0)
    assert len(read) == len(set(read)) == STEPS * GLOBAL  # none twice
    assert set(read) == {order.start(i) for i in range(STEPS * GLOBAL)}  # none skipped
    assert STEPS * GLOBAL <= order.num_windows  # all within one epoch

    for name, value in fixed["params"].items():
        torch.testing.assert_close(
            torch.tensor(result["out"]["params"][name]), torch.tensor(value),
            atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}",
        )  # fmt: skip
    fixed_by_step = {h["step"]: h for h in fixed["history"]}
    assert history[-1]["loss"] == pytest.approx(fixed_by_step[STEPS]["loss"], rel=1e-4)
    for h in history:  # the schedule continued from the checkpoint, not from step 0
        assert h["lr"] == pytest.approx(fixed_by_step[h["step"]]["lr"], rel=1e-9)
