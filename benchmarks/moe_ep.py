"""Expert parallelism vs FSDP2 alone: ``python -m benchmarks.moe_ep``.

One transformers Qwen3-MoE (built with ``from_config``, fp32) trained on 4
gloo ranks three ways on the same global batch, each rank reading its own
rows (EP leaves the data as it is): **fsdp** (``expert_parallel_size: 1``,
every expert sharded over the 4 ranks), **ep2** (ep 2 x efsdp 2) and **ep4**
(each rank holds a quarter of the experts whole). Per layout:

- bytes each rank sends in one training step (forward, backward, the global
  clip, AdamW), COUNTED from the collectives issued
  (:class:`benchmarks._collectives.CollectiveLog` sees every c10d and
  functional collective at torch's dispatcher), by kind and process group;
  the experts' share beside what ``ray-fsdp plan`` estimates for them
  (``memory.estimate_expert_traffic`` on the shape ``--hf-config`` reads).
  The dense modules are sharded over the same 4 ranks in every layout, so
  the experts' share under fsdp is its all-gather / reduce-scatter less the
  dense modules' (counted on their own group in the EP layouts);
- model state per rank: parameters, gradients and AdamW moments held
  (``_measure.state_bytes``, max over ranks) and the peak of what a step
  adds (unsharded parameters and gradients, collective buffers), sampled at
  every op;
- step time, the layouts alternated (``_measure.alternate``), and the first
  step's global loss (equal across layouts: same weights, same batch).

    python -m benchmarks.moe_ep [--reps 5] [--steps 2] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import _measure
from benchmarks._collectives import CollectiveLog
from ray_fsdp_backend import FSDPConfig, build_strategy
from ray_fsdp_backend.distributed.mesh import build_device_mesh, resolve_layout
from ray_fsdp_backend.planning.experts import moe_model_from_hf
from ray_fsdp_backend.planning.memory import estimate_expert_traffic
from ray_fsdp_backend.planning.topology import (
    EP_AXIS,
    EXPERT_SHARD_AXIS,
    SHARD_AXIS,
    topology_from_node_counts,
)

WORLD = 4
LAYOUTS = {"fsdp": 1, "ep2": 2, "ep4": 4}  # name: expert_parallel_size
MODEL = dict(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    intermediate_size=256,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
QUICK_MODEL = {**MODEL, "hidden_size": 32, "num_hidden_layers": 2, "moe_intermediate_size": 32}
SEQ, GLOBAL_BATCH, LR, MAX_NORM = 64, 8, 1e-3, 1.0
EXPERT_KINDS = ("all_to_all", "all_gather", "reduce_scatter")


def moe_config(model: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**model)


@dataclass
class Run:
    strategy: object
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    groups: dict[str, str]


def _global_batch(model: dict, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model["vocab_size"], (GLOBAL_BATCH, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _setup(rank: int, ep: int, model: dict, seq: int) -> Run:
    from transformers import AutoModelForCausalLM

    cfg = FSDPConfig(use_fsdp=True, use_mixed_precision=False, expert_parallel_size=ep)
    layout = resolve_layout(cfg, topology_from_node_counts([WORLD]))
    mesh = build_device_mesh(layout, "cpu")
    strategy = build_strategy(cfg, device=torch.device("cpu"), local_rank=rank, mesh=mesh)
    torch.manual_seed(0)  # the same weights in every layout
    wrapped = strategy.wrap(AutoModelForCausalLM.from_config(moe_config(model)))
    dp_rank, dp_size = layout.data_parallel_coordinates(rank)
    rows = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
    x, y = _global_batch(model, seq)
    axes = (SHARD_AXIS, EP_AXIS, EXPERT_SHARD_AXIS) if ep > 1 else (SHARD_AXIS,)
    # Axes over the same ranks may share one group (ep 4 = dp_shard): one label names both.
    labels: dict[str, list[str]] = {}
    for axis in axes:
        labels.setdefault(mesh[axis].get_group().group_name, []).append(axis)
    groups = {name: "+".join(shared) for name, shared in labels.items()}
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, foreach=False)
    return Run(strategy, wrapped, opt, x[rows], y[rows], groups)


def _step(run: Run) -> float:
    run.opt.zero_grad(set_to_none=True)
    logits = run.model(run.x).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), run.y.flatten())
    loss.backward()
    run.strategy.clip_grad_norm(run.model, MAX_NORM)
    run.opt.step()
    return float(loss.detach())


def _global_loss(local: float) -> float:
    t = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / WORLD


def _counted_step(run: Run) -> dict:
    """One step under the counter: bytes sent and calls by (kind, group)
    on this rank, and the peak model state the step adds."""
    log = CollectiveLog(run.groups, run.model)
    with log:
        _step(run)
    return {
        "sent": {f"{k}@{g}": n for (k, g), n in log.sent("kind", "group").items()},
        "calls": {f"{k}@{g}": n for (k, g), n in log.calls("kind", "group").items()},
        "peak_transient": log.peak_transient,
    }


def on_rank(rank: int, world: int, *, model: dict, seq: int, reps: int, steps: int) -> dict:
    assert world == WORLD, world
    runs, first, counted, memory = {}, {}, {}, {}
    for name, ep in LAYOUTS.items():
        runs[name] = _setup(rank, ep, model, seq)
        first[name] = _global_loss(_step(runs[name]))
        _step(runs[name])  # AdamW's moments exist from here on
        counted[name] = _counted_step(runs[name])
        memory[name] = _measure.state_bytes(runs[name].model, runs[name].opt)
    times = _measure.alternate(
        {name: (lambda r=r: _step(r)) for name, r in runs.items()}, reps=reps, steps=steps
    )
    everyone = [None] * world
    dist.all_gather_object(everyone, counted)
    return {
        "world_size": world,
        "model": model,
        "seq": seq,
        "global_batch": GLOBAL_BATCH,
        "first_loss": first,
        "per_rank": everyone,
        "state": memory,
        "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        "times": times,
    }


def _kinds(sent: dict[str, int], axis: str, kinds: tuple[str, ...]) -> dict[str, int]:
    """Bytes by kind (of ``kinds``) over the collectives on ``axis``'s group."""
    out = dict.fromkeys(kinds, 0)
    for key, n in sent.items():
        kind, label = key.split("@")
        if kind in kinds and axis in label.split("+"):
            out[kind] += n
    return out


FSDP_KINDS = ("all_gather", "reduce_scatter")


def dense_bytes(result: dict, rank: int) -> dict[str, int]:
    """What ``rank`` sent for the dense modules: FSDP2's all-gather and
    reduce-scatter on dp_shard under ep2 (the same units and mesh in every
    layout; under fsdp the experts share their collectives)."""
    return _kinds(result["per_rank"][rank]["ep2"]["sent"], SHARD_AXIS, FSDP_KINDS)


def expert_bytes(result: dict, name: str, rank: int) -> dict[str, int]:
    """What ``rank`` sent for the experts under layout ``name``: the
    all-to-alls on ep and FSDP2's collectives on efsdp; under fsdp, the
    all-gather / reduce-scatter on dp_shard less the dense modules'."""
    sent = result["per_rank"][rank][name]["sent"]
    if LAYOUTS[name] > 1:
        moved = _kinds(sent, EXPERT_SHARD_AXIS, FSDP_KINDS)
        return {**_kinds(sent, EP_AXIS, ("all_to_all",)), **moved}
    whole, dense = _kinds(sent, SHARD_AXIS, FSDP_KINDS), dense_bytes(result, rank)
    return {"all_to_all": 0, **{kind: whole[kind] - dense[kind] for kind in FSDP_KINDS}}


def planned(result: dict, name: str) -> dict[str, int]:
    """``ray-fsdp plan``'s estimate of the experts' bytes per rank (fp32)."""
    experts = moe_model_from_hf(moe_config(result["model"]).to_dict()).experts
    tokens = GLOBAL_BATCH // WORLD * result["seq"]
    est = estimate_expert_traffic(
        experts, tokens, ep=LAYOUTS[name], shard_size=WORLD, value_bytes=4, reduce_bytes=4
    )
    return {kind: getattr(est, kind) for kind in EXPERT_KINDS}


def summarize(result: dict) -> dict:
    """Per layout: bytes sent per rank (max and mean over ranks, and the
    experts' share by kind, counted and planned), model state, step time."""
    out = {}
    ranks = range(result["world_size"])
    for name in LAYOUTS:
        totals = [sum(result["per_rank"][r][name]["sent"].values()) for r in ranks]
        experts = [expert_bytes(result, name, r) for r in ranks]
        state = result["state"][name]
        peak = max(result["per_rank"][r][name]["peak_transient"] for r in ranks)
        out[name] = {
            "ms": result["ms"][name],
            "vs_fsdp": _measure.compare(result["times"][name], result["times"]["fsdp"]),
            "sent_max": max(totals),
            "sent_mean": statistics.mean(totals),
            "experts_mean": {k: statistics.mean(e[k] for e in experts) for k in EXPERT_KINDS},
            "experts_max": {k: max(e[k] for e in experts) for k in EXPERT_KINDS},
            "planned": planned(result, name),
            "dense": dense_bytes(result, 0),
            "state": sum(state.values()),
            "peak": sum(state.values()) + peak,
            "first_loss": result["first_loss"][name],
        }
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(result: dict) -> str:
    """The markdown table docs/benchmarks.md shows, and a line on the dense
    modules' traffic (the same in every layout)."""
    rows = summarize(result)
    lines = [
        "| layout | step ms (paired ratio to fsdp: median, range) "
        "| MiB sent / rank, all collectives (max over ranks) "
        "| experts' all-to-all / all-gather / reduce-scatter MiB / rank, counted "
        "(mean over ranks) | the same, `ray-fsdp plan` | model state MiB / rank "
        "| peak model state in a step MiB / rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        counted = " / ".join(_mib(row["experts_mean"][k]) for k in EXPERT_KINDS)
        plan = " / ".join(_mib(row["planned"][k]) for k in EXPERT_KINDS)
        ratio = row["vs_fsdp"]
        lines.append(
            f"| {name} | {row['ms']:.1f} ({ratio['ratio']:.2f}, {ratio['ratio_min']:.2f}"
            f"–{ratio['ratio_max']:.2f}) | {_mib(row['sent_max'])} "
            f"| {counted} | {plan} | {_mib(row['state'])} | {_mib(row['peak'])} |"
        )
    dense = " / ".join(_mib(n) for n in rows["fsdp"]["dense"].values())
    return "\n".join(lines) + f"\n\ndense modules' all-gather / reduce-scatter: {dense} MiB"


def _on_rank(rank: int, world: int, kwargs: dict) -> dict:
    torch.set_num_threads(1)  # one intra-op thread per rank (benchmarks.run)
    return on_rank(rank, world, **kwargs)


def main(argv=None) -> None:
    from tests.dist.harness import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smaller model, one rep")
    parser.add_argument("--out", help="write the raw result and summary as JSON here")
    args = parser.parse_args(argv)
    kwargs = dict(model=QUICK_MODEL if args.quick else MODEL, seq=16 if args.quick else SEQ)
    kwargs.update(reps=1 if args.quick else args.reps, steps=1 if args.quick else args.steps)
    result = run_ranks(_on_rank, WORLD, kwargs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"result": result, "summary": summarize(result)}, f, indent=1)
    print(table(result))
    losses = result["first_loss"]
    print(f"first global loss: {losses}")


if __name__ == "__main__":
    main()
