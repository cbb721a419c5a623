"""Worker side of the elastic end-to-end test: the example's own training loop,
with every window start each rank reads written to a JSON-lines file.

``train_recording`` runs :func:`ray_fsdp_backend.trainer.loop.train.train_loop_per_worker`
unchanged; it only wraps the loop's data stream (to record what is read) and
its optimizer builder (to keep the model, whose full parameters it returns).
``loop_config["_record"]`` holds the record directory and the hold rule: a
group of ``hold_at_world_size`` ranks stops after ``hold_after_steps`` steps
while the file ``hold`` exists there, so the driver can grow the cluster
while the smaller group is still running.
"""

from __future__ import annotations

import json
import os
import time

import ray_fsdp_backend as rfb
from ray_fsdp_backend.trainer.loop import train as example_train
from tests.e2e.ckpt_fns import full_params


class RecordingBatches:
    """A ``ShardedBatches`` whose window starts are written, one line per micro-batch."""

    def __init__(self, inner, record: dict, ctx, dp_size: int) -> None:
        self.inner, self.record, self.world_size = inner, record, ctx.world_size
        self.mesh, self.dp_size = list(ctx.mesh.shape), dp_size
        self.ranks = {"dp": ctx.dp_rank, "tp": ctx.tp_rank}  # tp peers read the same rows
        self.path = os.path.join(record["dir"], f"rank{ctx.world_rank}_pid{os.getpid()}.jsonl")
        self.batches = 0
        self._starts: list[int] = []
        start = inner.order.start
        inner.order.start = lambda s: self._starts.append(start(s)) or self._starts[-1]

    @property
    def position(self) -> int:
        return self.inner.position

    def next_batch(self):
        self._maybe_hold()
        position = self.inner.position
        self._starts.clear()
        out = self.inner.next_batch()
        line = {"t": time.time(), "ws": self.world_size, "mesh": self.mesh, "position": position,
                **self.ranks}  # fmt: skip
        with open(self.path, "a") as f:
            f.write(json.dumps({**line, "starts": list(self._starts)}) + "\n")
        self.batches += 1
        time.sleep(self.record.get("pace_s", 0.0))
        return out

    def _maybe_hold(self) -> None:
        rule = self.record
        if self.world_size != rule.get("hold_at_world_size"):
            return
        accum = rule["global_batch_size"] // (self.dp_size * self.inner.micro_batch_size)
        deadline = time.time() + rule.get("hold_timeout_s", 120)
        if self.batches < rule["hold_after_steps"] * accum:
            return
        while os.path.exists(os.path.join(rule["dir"], "hold")) and time.time() < deadline:
            time.sleep(0.2)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)


def train_recording(loop_config: dict) -> dict:
    config = dict(loop_config)
    record = config.pop("_record")
    ctx = rfb.get_context()
    kept = {}
    build_batches, build_optimizer = example_train.build_batches, example_train.build_optimizer

    def recording_batches(spec, dp_rank, dp_size):
        return RecordingBatches(build_batches(spec, dp_rank, dp_size), record, ctx, dp_size)

    def keeping_optimizer(model, spec):
        kept["model"] = model
        return build_optimizer(model, spec)

    example_train.build_batches = recording_batches
    example_train.build_optimizer = keeping_optimizer
    history = example_train.train_loop_per_worker(config)
    return {"history": history, "params": full_params(kept["model"])}
