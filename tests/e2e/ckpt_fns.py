"""Worker-side training functions of the checkpoint end-to-end tests.

``train_resumable`` trains ToyNet with AdamW on data that depends on the step
and on each rank's torch generator (so an exact resume needs the model, the
optimizer moments, the step and the RNG state), checkpoints every
``every`` steps and can inject faults, each once per run: a worker process dies
(``os._exit``) at the start of a step, right after a checkpoint was reported, or
during a save before the checkpoint is committed. Per-attempt facts go to
JSON files in ``loop_config["fault_dir"]``, with the gathered parameters after
step ``loop_config["params_at"]`` where it is set. With ``loop_config["pretrained"]``
the model is that tiny Llama with LoRA adapters on its frozen base (adapter
dropout: the rank's RNG enters the loss) on step-seeded token ids.
"""

from __future__ import annotations

import json
import os
import time

import ray.train
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import ray_fsdp_backend as rfb
from ray_fsdp_backend.checkpoint import sharded
from tests.models import make_batch, reference_model


def next_attempt(fault_dir: str) -> int:
    """This group's attempt number (0 first), agreed by all ranks."""
    if dist.get_rank() == 0:
        attempt = len([f for f in os.listdir(fault_dir) if f.startswith("start_")])
        open(os.path.join(fault_dir, f"start_{attempt}"), "w").close()
    dist.barrier()
    return len([f for f in os.listdir(fault_dir) if f.startswith("start_")]) - 1


def full_params(model) -> dict[str, list]:
    """The trainable parameters, gathered (LoRA: the adapters only)."""
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    return {k: v.tolist() for k, v in get_model_state_dict(model, options=options).items()}


def _batch(ctx, step: int):
    x, y = make_batch(16, seed=step)
    per = 16 // ctx.dp_size
    x, y = (
        x[ctx.dp_rank * per : (ctx.dp_rank + 1) * per],
        y[ctx.dp_rank * per : (ctx.dp_rank + 1) * per],
    )
    return x + 0.1 * torch.randn_like(x), y  # the rank's generator enters the data


def _mean(value: float, ctx) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t)  # SUM then divide: gloo has no reliable AVG
    return float(t) / ctx.world_size


def _fault(loop_config: dict, attempt: int, rank: int, step: int, where: str) -> bool:
    """Whether an injected fault fires here: each fires once per run (its
    ``fired_<i>`` file records the attempt), so a restart does not repeat it."""
    for i, f in enumerate(loop_config.get("faults", [])):
        if (f["rank"], f["step"], f["where"]) != (rank, step, where):
            continue
        marker = os.path.join(loop_config["fault_dir"], f"fired_{i}")
        if not os.path.exists(marker):
            with open(marker, "w") as out:
                out.write(str(attempt))
            return True
    return False


def _toy(ctx, loop_config: dict):
    """ToyNet and its step loss."""
    model = ctx.wrap(reference_model())

    def loss(step: int):
        x, y = _batch(ctx, step)
        return torch.nn.functional.mse_loss(model(x), y)

    return model, loss


def _lora(ctx, loop_config: dict):
    """The tiny pretrained Llama with LoRA adapters, and its step loss."""
    from ray_fsdp_backend.models.tiny_pretrained import VOCAB
    from ray_fsdp_backend.trainer.loop.pretrained import build_pretrained
    from ray_fsdp_backend.trainer.schema.pretrained import PretrainedModelConfig

    lora = {"r": 4, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
    lora.update(loop_config.get("lora", {}))  # QLoRA: base_quantization nf4
    cfg = PretrainedModelConfig.from_dict({"pretrained": loop_config["pretrained"], "lora": lora})
    model = build_pretrained(ctx, cfg)

    def loss(step: int):
        ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(step))
        per = 4 // ctx.dp_size
        ids = ids[ctx.dp_rank * per : (ctx.dp_rank + 1) * per]
        return model(input_ids=ids, labels=ids).loss

    return model, loss


def train_resumable(loop_config: dict) -> dict:
    ctx = rfb.get_context()
    fault_dir = loop_config["fault_dir"]
    attempt = next_attempt(fault_dir)
    torch.manual_seed(1000 + ctx.world_rank)
    model, step_loss = (_lora if loop_config.get("pretrained") else _toy)(ctx, loop_config)
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    opt = torch.optim.AdamW(trainable, lr=0.02, weight_decay=0.1)
    handed = ray.train.get_checkpoint()
    extra = ctx.restore_checkpoint(model, opt)
    start = extra["step"] if extra else 0
    record = {
        "resumed_from": start,
        "handed": None if handed is None else os.path.basename(handed.path),
        "losses": {},
    }
    path = os.path.join(fault_dir, f"attempt_{attempt}.json")

    for step in range(start + 1, loop_config["steps"] + 1):
        if _fault(loop_config, attempt, ctx.world_rank, step, "mid_step"):
            os._exit(1)
        opt.zero_grad()
        loss = step_loss(step)
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
        if _fault(loop_config, attempt, ctx.world_rank, step, "during_save"):
            sharded.commit_checkpoint = lambda *args: os._exit(1)  # shards written, no marker
        ctx.save_checkpoint(
            model, opt, {"step": step, "loss": record["losses"][step]}, extra_state={"step": step}
        )
        if _fault(loop_config, attempt, ctx.world_rank, step, "after_save"):
            os._exit(1)
    if loop_config.get("export"):
        ctx.export_model(model, loop_config["export"])
    return {"params": full_params(model), "attempt": attempt, **record}


def restore_then_hang(loop_config: dict) -> None:
    """Restore the checkpoint Ray hands the run (another run's), save what was
    loaded, then let rank 1 sleep while the others enter a collective."""
    ctx = rfb.get_context()
    model = ctx.wrap(reference_model(seed=7))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    extra = ctx.restore_checkpoint(model, opt, checkpoint=loop_config["checkpoint"])
    params = full_params(model)
    if ctx.world_rank == 0:
        with open(loop_config["restored"], "w") as f:
            json.dump(
                {
                    "extra": extra,
                    "params": params,
                    "strategy": type(ctx.strategy).__name__,
                    "world_size": ctx.world_size,
                    "time": time.time(),
                },
                f,
            )
    if ctx.world_rank == 1:
        time.sleep(loop_config["sleep_s"])
    dist.all_reduce(torch.ones(1))
