"""Worker-side function of the tensor-parallel end-to-end test.

``train_tp`` trains the example decoder at tp 2 on Ray workers (any dp) with
AdamW and the global clip, each dp shard reading its rows of a step-seeded
global batch, checkpoints every ``every`` steps and can kill one worker
(``os._exit``) right after a checkpoint, once per run. Per-attempt facts go
to JSON files in ``loop_config["fault_dir"]``.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import ray_fsdp_backend as rfb
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from tests.e2e.ckpt_fns import next_attempt

MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)
BATCH, LR, MAX_NORM = 4, 3e-3, 0.05


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["seq_len"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_tp(loop_config: dict) -> dict:
    ctx = rfb.get_context()
    attempt = next_attempt(loop_config["fault_dir"])
    with torch.device("meta"):
        model = Transformer(ModelConfig(**MODEL))
    model = ctx.wrap(model)
    rfb.load_pretrained(model, loop_config["init"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    extra = ctx.restore_checkpoint(model, opt)
    start = extra["step"] if extra else 0
    tp_group = dist.get_process_group_ranks(ctx.mesh["tp"].get_group())
    record = {"resumed_from": start, "losses": {}, "norms": {}, "tp_group": tp_group,
              "coords": [ctx.dp_rank, ctx.dp_size, ctx.tp_rank, ctx.tp_size]}  # fmt: skip
    per = BATCH // ctx.dp_size
    for step in range(start + 1, loop_config["steps"] + 1):
        x, y = (t[ctx.dp_rank * per : (ctx.dp_rank + 1) * per] for t in global_batch(step))
        with ctx.loss_parallel():
            loss = model.loss(x, y)
            loss.backward()
        norm = ctx.clip_grad_norm(model, MAX_NORM, optimizer=opt)
        opt.step()
        opt.zero_grad()
        summed = torch.tensor(loss.item())
        dist.all_reduce(summed)  # the tp ranks of a dp shard hold the same loss
        record["losses"][step] = float(summed) / ctx.world_size
        record["norms"][step] = float(norm)
        if ctx.world_rank == 0:
            with open(os.path.join(loop_config["fault_dir"], f"attempt_{attempt}.json"), "w") as f:
                json.dump(record, f)
        if step % loop_config["every"] == 0:
            ctx.save_checkpoint(model, opt, {"step": step}, extra_state={"step": step})
            kill = loop_config.get("kill")
            marker = os.path.join(loop_config["fault_dir"], "fired")
            if kill == [ctx.world_rank, step] and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
    return {"record": record, "rank": ctx.world_rank}
