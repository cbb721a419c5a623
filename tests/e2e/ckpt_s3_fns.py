"""Worker-side training function of the object-storage checkpoint tests.

``train_on_store`` is ``ckpt_fns.train_resumable``'s job (ToyNet, AdamW, data
from the step and each rank's generator, a checkpoint every ``every`` steps)
with a wider model, synchronous or asynchronous saves, and these faults, each
once per run: ``after_save`` (the process dies right after a save returned),
``async_write_fail`` (this rank's background write raises) and
``server_gone`` (rank 0 asks the test to stop the S3 server and waits until
it is gone, before the save). Each rank records the bytes it read from the
store during its restore (``tests.counting_fs``); the attempt's record holds
the gathered parameters after step ``params_at`` and, with
``record_restored``, those it restored.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch

import ray_fsdp_backend as rfb
from ray_fsdp_backend.checkpoint import sharded
from ray_fsdp_backend.checkpoint.layout import checkpoint_name, names_in
from ray_fsdp_backend.checkpoint.ray_run import run_store
from ray_fsdp_backend.storage import retry
from tests import counting_fs
from tests.e2e.ckpt_fns import _batch, _fault, _mean, full_params, next_attempt
from tests.models import reference_model

MODEL = {"dim": 256, "n_layers": 4}


def _failing_writer(make):
    def patched(*args):
        writer = make(*args)

        def write_data(plan, planner):
            raise OSError("injected failure in the background write")

        writer.write_data = write_data
        return writer

    return patched


def _wait_server_gone(loop_config: dict, last: str) -> None:
    """Let Ray register checkpoint ``last`` first (its controller writes to the
    store too, and should not be the one to find the server gone), then ask
    the test to stop the server and wait until it is."""
    store = run_store()
    for _ in range(600):
        if last in names_in(store.read_text("checkpoint_manager_snapshot.json")):
            break
        time.sleep(0.1)
    open(os.path.join(loop_config["fault_dir"], "stop_server"), "w").close()
    host, port = loop_config["endpoint"].split(":")
    for _ in range(600):
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
        except OSError:
            return
        time.sleep(0.1)


def _restore(ctx, model, opt, loop_config: dict, attempt: int):
    before = counting_fs.BYTES_READ[0]
    extra = ctx.restore_checkpoint(model, opt, checkpoint=loop_config.get("checkpoint"))
    read = counting_fs.BYTES_READ[0] - before
    path = os.path.join(loop_config["fault_dir"], f"read_{attempt}_{ctx.world_rank}.json")
    with open(path, "w") as f:
        json.dump({"bytes": read, "world_size": ctx.world_size}, f)
    return extra


def train_on_store(loop_config: dict) -> dict:
    ctx = rfb.get_context()
    attempt = next_attempt(loop_config["fault_dir"])
    torch.manual_seed(1000 + ctx.world_rank)
    model = ctx.wrap(reference_model(**MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    extra = _restore(ctx, model, opt, loop_config, attempt)
    start = extra["step"] if extra else 0
    record = {"resumed_from": start, "world_size": ctx.world_size, "losses": {}}
    if extra and loop_config.get("record_restored"):  # every rank gathers
        record["restored"] = full_params(model)
    path = os.path.join(loop_config["fault_dir"], f"attempt_{attempt}.json")
    if ctx.world_rank == 0:
        with open(path, "w") as f:
            json.dump(record, f)
    for step in range(start + 1, loop_config["steps"] + 1):
        x, y = _batch(ctx, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        record["losses"][step] = _mean(float(loss), ctx)
        if step == loop_config.get("params_at"):  # every rank gathers
            record["params_at"] = full_params(model)
        if ctx.world_rank == 0:
            with open(path, "w") as f:
                json.dump(record, f)
        if step % loop_config["every"]:
            continue
        if _fault(loop_config, attempt, ctx.world_rank, step, "async_write_fail"):
            sharded.dcp_writer = _failing_writer(sharded.dcp_writer)
        if _fault(loop_config, attempt, ctx.world_rank, step, "server_gone"):
            _wait_server_gone(loop_config, checkpoint_name(step // loop_config["every"] - 1))
        ctx.save_checkpoint(
            model,
            opt,
            {"step": step, "loss": record["losses"][step]},
            extra_state={"step": step},
            async_save=loop_config.get("async_save", False),
        )
        if _fault(loop_config, attempt, ctx.world_rank, step, "after_save"):
            os._exit(1)
    retries = retry.STATS.snapshot()[0]
    return {"params": full_params(model), "attempt": attempt, "retries": retries, **record}
