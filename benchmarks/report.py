"""Markdown tables of ``benchmarks.run`` results (what docs/benchmarks.md quotes)."""

from __future__ import annotations

from pathlib import Path

DOCS_START = "<!-- benchmark results: start (python -m benchmarks.run --update-docs) -->"
DOCS_END = "<!-- benchmark results: end -->"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio(t: dict) -> str:
    return f"{t['ratio']:.3f} ({t['ratio_min']:.2f}–{t['ratio_max']:.2f})"


def _over(part: float, whole: float) -> str:
    return f"{part / whole:.2f}" if whole > 0 else "-"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _step_time(results: list[dict]) -> list[str]:
    rows = [
        [
            r["world_size"],
            s["strategy"],
            "×".join(map(str, s["mesh"])),
            f"{s['time']['a_ms']:.1f}",
            f"{s['time']['b_ms']:.1f}",
            _ratio(s["time"]),
            "yes" if s["same_loss"] else "NO",
        ]
        for r in results
        for s in r["strategies"]
    ]
    header = ["ranks", "strategy", "mesh", "ours ms", "hand-written ms", "ratio (min–max)"]
    return [
        "#### 1. Step time: `ctx.wrap` + `clip_grad_norm` + `no_sync` vs hand-written "
        "`fully_shard` (target ratio ≤ 1.02)",
        "",
        *_table([*header, "same first loss"], rows),
    ]


def _memory(results: list[dict]) -> list[str]:
    rows = []
    for r in results:
        for s in r["strategies"]:
            m = s["memory"]
            rows.append(
                [
                    r["world_size"],
                    s["strategy"],
                    _mib(m["total_per_rank"]),
                    _mib(sum(m["hand"].values())),
                    _mib(m["ideal_total_over_n"]),
                    f"{m['vs_ideal']:.2f}",
                    f"{m['vs_ddp']:.2f}",
                    _mib(m["plan_estimate"]),
                ]
            )
        rows.append([r["world_size"], "ddp", _mib(r["ddp"]["total_per_rank"]), "", "", "", "1.00",
                     _mib(r["ddp"]["plan_estimate"])])  # fmt: skip
    header = ["ranks", "strategy", "ours MiB/rank", "hand-written MiB/rank", "ideal total/N MiB",
              "vs ideal", "vs DDP", "`ray-fsdp plan` MiB"]  # fmt: skip
    return [
        "#### 2. Memory per rank: parameters + gradients + AdamW state (largest rank)",
        "",
        *_table(header, rows),
    ]


def _clipping(results: list[dict]) -> list[str]:
    rows = [
        [
            r["world_size"],
            row["tensors"],
            f"{row['time']['a_ms']:.2f}",
            f"{row['time']['b_ms']:.2f}",
            _ratio(row["time"]),
            row["ours_collectives"],
            row["torch_collectives"],
        ]
        for r in results
        for row in r["rows"]
    ]
    header = ["ranks", "tensors", "ours ms", "torch ms", "ratio", "ours collectives",
              "torch collectives"]  # fmt: skip
    mixed = results[0]["mixed_sharded_and_plain"]
    return [
        "#### 3. Clipping: global-norm clip vs `torch.nn.utils.clip_grad_norm_` on DTensor grads",
        "",
        *_table(header, rows),
        f"Sharded and plain gradients in one call: ours {mixed['ours']}; torch {mixed['torch']}.",
        "",
    ]


def _startup(r: dict) -> list[str]:
    return [
        "#### 4. Start-up: `fit()` to the end of the first step (target ≤ +1 s)",
        "",
        *_table(
            ["workers", "FSDPConfig s", "TorchConfig + hand-written FSDP2 s", "extra s", "fits"],
            [
                [
                    r["workers"],
                    f"{r['ours_s']:.2f}",
                    f"{r['ray_torch_config_s']:.2f}",
                    f"{r['extra_s']:+.2f}",
                    2 * r["reps"],
                ]
            ],  # fmt: skip
        ),
    ]


def _dmuon(r: dict) -> list[str]:
    rows = []
    for size in r["results"]:
        for ranks, d in size["dmuon"].items():
            rows.append(
                [
                    size["d_model"],
                    ranks,
                    f"{d['a_ms']:.1f}",
                    f"{d['b_ms']:.1f}",
                    _ratio(d),
                    "/".join(f"{ms:.1f}" for ms in d["ns_ms_per_rank"]),
                    "/".join(f"{x:.2f}" for x in d.get("cpu_ratio_per_rank", [])),
                    _mib(d["bytes_sent_per_rank"]),
                    _mib(d["fsdp_adamw_step_bytes_per_rank"]),
                    _mib(max(d["momentum_bytes_per_rank"])),
                    _mib(size["momentum_bytes_single_process"]),
                    "/".join(map(str, d["ns_matrices_per_rank"])),
                ]
            )
    header = ["d_model", "ranks", "DMuon step ms", "torch Muon ms", "ratio",
              "NS ms per rank", "CPU-time ratio per rank", "DMuon MiB sent/rank",
              "FSDP2+AdamW step MiB sent/rank", "momentum MiB/rank", "momentum MiB, 1 process",
              "NS matrices per rank"]  # fmt: skip
    return [
        "#### 5. DMuon optimizer step vs single-process `torch.optim.Muon` (bf16 NS)",
        "",
        *_table(header, rows),
    ]


def _scaling(r: dict) -> list[str]:
    rows = [
        [
            series,
            row["dim"],
            row["n_layers"],
            f"{row['params']:,}",
            f"{row['step_ms']:.1f}",
            f"{row['flops_ratio']:.2f}",
            f"{row['time_ratio']:.2f}",
            f"{row['params_ratio']:.2f}",
            f"{row['memory_ratio']:.2f}",
        ]
        for series, series_rows in r["series"].items()
        for row in series_rows
    ]
    header = ["doubling", "dim", "layers", "params", "step ms", "FLOPs ×", "time ×",
              "params ×", "memory/rank ×"]  # fmt: skip
    return [
        f"#### 6. Scaling: {r['strategy']} on {r['world_size']} ranks as width and depth double",
        "",
        *_table(header, rows),
    ]


def _compile(r: dict) -> list[str]:
    m = r["model"]
    row = [
        r["world_size"],
        f"dim {m['dim']}, {m['n_layers']} layers, seq {m['seq_len']}",
        f"{r['time']['a_ms']:.1f}",
        f"{r['time']['b_ms']:.1f}",
        _ratio(r["time"]),
        f"{r['compile_s']:.1f}",
        "yes" if r["same_loss"] else "NO",
    ]
    header = ["ranks", "model", "compiled ms", "eager ms", "ratio (min–max)", "compile s",
              "same first loss"]  # fmt: skip
    return [
        "#### 7. `compile: true` (compiled blocks) vs eager: FSDP2 full_shard step time",
        "",
        *_table(header, [row]),
    ]


def _pretrained(r: dict) -> list[str]:
    rows = [
        [
            row["world_size"],
            _mib(row["ours"]["peak_bytes_per_rank"]),
            _mib(row["full"]["peak_bytes_per_rank"]),
            f"{row['ours']['peak_bytes_per_rank'] / row['full']['peak_bytes_per_rank']:.2f}",
            f"{row['ours']['load_s']:.2f}",
            f"{row['full']['load_s']:.2f}",
            f"{row['ours']['load_s'] / row['full']['load_s']:.2f}",
        ]
        for row in r["rows"]
    ]
    header = ["ranks", "ours: peak MiB added/rank", "from_pretrained + wrap: MiB/rank",
              "memory ×", "ours s", "from_pretrained + wrap s", "time × (of medians)"]  # fmt: skip
    return [
        f"#### 8. Loading a pretrained checkpoint ({r['params'] / 1e6:.0f}M parameters, "
        f"{_mib(r['checkpoint_bytes'])} MiB bf16 safetensors, trained in fp32: "
        f"{_mib(r['fp32_bytes'])} MiB), FSDP2 full_shard",
        "",
        *_table(header, rows),
    ]


def _checkpoint_io(results: list[dict]) -> list[str]:
    rows = []
    for r in results:
        for store, m in r["stores"].items():
            read = (
                f"{_mib(m['read'])} ({m['read'] / m['size']:.2f}x) vs "
                f"{_mib(m['read_before'])} ({m['read_before'] / m['size']:.2f}x)"
                if m["read"]
                else "in place"
            )
            rows.append([
                r["world_size"], store, _mib(m["size"]), read, f"{m['save_s']:.2f}",
                f"{m['restore_s']:.2f} vs {m['restore_before_s']:.2f}" if m["read"]
                else f"{m['restore_s']:.2f} (in place, as before)",
                f"{m['stall_sync_s']:.2f}", f"{m['stall_async_s']:.2f}",
                _over(m["stall_async_s"], m["stall_sync_s"]),
                f"{m['staged_s']:.2f}", _over(m["staged_s"], m["stall_sync_s"]),
            ])  # fmt: skip
    header = ["ranks", "store", "checkpoint MiB", "MiB read per restore: ranged vs before",
              "save s", "restore s: ranged vs before", "stall sync s", "stall async s",
              "async/sync", "async staged s", "staged/sync"]  # fmt: skip
    return [
        "#### 9. Checkpoints: bytes read per restore (all ranks; target ≤ 1.2x), save and "
        "restore time, training time lost per checkpoint (target async ≤ 0.25 of sync)",
        "",
        *_table(header, rows),
    ]


def _lora(r: dict) -> list[str]:
    rows = []
    for row in r["rows"]:
        full = row["full"]
        for side in ("full", "lora_r8", "lora_r64", "qlora_r8"):
            if side not in row:  # results from before QLoRA
                continue
            m = row[side]
            state = m["state"]
            base = _mib(m["base_bytes_per_rank"]) if "base_bytes_per_rank" in m else "-"
            if m.get("nf4_params_per_rank"):  # NF4 bytes against the same weights in bf16
                base += (
                    f" (NF4 {m['nf4_bytes_per_rank'] / (2 * m['nf4_params_per_rank']):.3f}x bf16)"
                )
            rows.append([
                row["world_size"], side.replace("_", " "), f"{m['trainable_params'] / 1e6:.2f}M",
                _mib(state["params"]), base, _mib(state["grads"]), _mib(state["optimizer"]),
                _mib(m["peak_bytes_per_rank"]), f"{m['step_s']:.3f}",
                f"{m['step_s'] / full['step_s']:.2f}", _mib(m["checkpoint_bytes"]),
                _over(m["checkpoint_bytes"], full["checkpoint_bytes"]),
            ])  # fmt: skip
    header = ["ranks", "training", "trainable", "params MiB/rank", "frozen base MiB/rank",
              "grads MiB/rank",
              "optimizer MiB/rank", "peak MiB added by steps/rank", "step s", "step × full",
              "checkpoint MiB per save", "checkpoint × full"]  # fmt: skip
    return [
        f"#### 10. LoRA (q/k/v/o_proj, r 8 and 64) and QLoRA (r 8, NF4 base) vs full "
        f"fine-tuning: {r['params'] / 1e6:.0f}M "
        f"parameters, fp32, FSDP2 full_shard, batch {r['batch']} x {r['seq']} per rank",
        "",
        *_table(header, rows),
    ]


def _hf_s3(r: dict) -> list[str]:
    rows = []
    for row in r["rows"]:
        after, before = row["after"], row.get("before")
        per_rank = ", ".join(_mib(b) for b in after["export_bytes_per_rank"])
        rows.append([
            row["world_size"],
            f"{before['load_s']:.2f}" if before else "-",
            f"{after['load_s']:.2f}",
            f"{before['load_s'] / after['load_s']:.1f}x" if before else "-",
            f"{before['requests']} / {_mib(before['store_bytes_down'])}" if before else "-",
            f"{after['requests']} / {_mib(after['store_bytes_down'])}",
            f"{_mib(after['max_rank_read'])}",
            f"{after['export_s']:.2f}",
            per_rank,
        ])  # fmt: skip
    header = ["ranks", "load s before", "load s after", "speed-up",
              "requests / MiB from store before", "requests / MiB after",
              "MiB read by one rank (max)", "export to S3 s", "MiB uploaded per rank"]  # fmt: skip
    return [
        f"#### 12. A Hugging Face checkpoint on S3 (moto) with {r['latency_s'] * 1000:.0f} ms "
        f"per request: {_mib(r['checkpoint_bytes'])} MiB bf16, {r['tensors']} tensors in "
        f"{r['files']} files, FSDP2 full_shard; before = commit {r['baseline']}",
        "",
        *_table(header, rows),
    ]


def _tensor_parallel(r: dict) -> list[str]:
    m, t = r["model"], r["time"]
    rows = []
    for name, ms in (("tp 2 x dp 2", t["a_ms"]), ("dp 4 (full_shard)", t["b_ms"])):
        mem = r["memory"]["tp2_dp2" if name.startswith("tp") else "dp4"]
        state = mem["params"] + mem["grads"] + mem["optimizer"]
        rows.append([name, f"{ms:.1f}", _mib(mem["params"]), _mib(state),
                     _mib(mem["activations_estimate"])])  # fmt: skip
    header = ["layout", "step ms", "params MiB / rank", "model state MiB / rank",
              "activations MiB / rank (estimate)"]  # fmt: skip
    return [
        f"#### 11. Tensor parallel vs FSDP2 on {r['world_size']} ranks: dim {m['dim']}, "
        f"{m['n_layers']} layers, seq {m['seq_len']}, global batch {r['global_batch']}, fp32",
        "",
        *_table(header, rows),
        "",
        f"tp 2 x dp 2 / dp 4 step time: {_ratio(t)}; same first loss: "
        + ("yes" if r["same_loss"] else "NO"),
        "",
        *_tp_traffic(r),
    ]


def _tp_traffic(r: dict) -> list[str]:
    """Issue 37: tp 2 x dp 2 before / after torchtitan's TP layout."""
    if "traffic" not in r:
        return []
    rows = []
    for key, label in (("sp", "sequence parallel"), ("no_sp", "no sequence parallel")):
        x = r["traffic"][key]
        sent, t = x["bytes_per_step"], x["time"]
        rows.append([label, f"{t['b_ms']:.1f}", f"{t['a_ms']:.1f}", _ratio(t),
                     _mib(sent["before"]), _mib(sent["after"]), _mib(x["block_estimate"]),
                     "yes" if x["same_loss"] else "NO"])  # fmt: skip
    header = ["tp 2 x dp 2", "before ms", "after ms", "after / before", "TP MiB / step before",
              "TP MiB / step after", "plan MiB / block", "same loss"]  # fmt: skip
    return [
        "TP traffic before / after one reduction per attention and per MLP (issue 37; "
        "MiB one rank sends over its tp group per step, ring):",
        "",
        *_table(header, rows),
    ]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


SECTIONS = {
    "step_time": lambda r: _step_time(r) + _memory(r),
    "clipping": _clipping,
    "startup": _startup,
    "dmuon": _dmuon,
    "scaling": _scaling,
    "compile": _compile,
    "pretrained": _pretrained,
    "checkpoint_io": _checkpoint_io,
    "lora": _lora,
    "tensor_parallel": _tensor_parallel,
    "hf_s3": _hf_s3,
}


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"### Latest results ({results['mode']})",
        "",
        f"{m['date']}, commit `{m['commit']}`: {m['cpu_cores']} CPU cores ({m['processor']}), "
        f"{m['platform']}, Python {m['python']}, torch {m['torch']}, Ray {m['ray']}, "
        f"{m['backend']}. Times are medians; a ratio is the median of per-repetition ratios "
        "of adjacent, alternating A/B blocks.",
        "",
    ]
    for name, render in SECTIONS.items():
        if name in results:
            lines += render(results[name])
    return "\n".join(lines)


def update_docs(page: Path, table: str) -> None:
    """Replace the text of ``page`` between the benchmark markers with ``table``.

    Raises:
        ValueError: ``page`` lacks the markers.
    """
    text = page.read_text()
    start, end = text.find(DOCS_START), text.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f"{page} has no '{DOCS_START}' ... '{DOCS_END}' section")
    head = text[: start + len(DOCS_START)]
    page.write_text(f"{head}\n\n{table.strip()}\n\n{text[end:]}")
