"""The held-out set and the epoch order on a local Ray cluster (issue 54, item 4).

``eval_fraction`` splits *records* by a seeded hash of each record's text,
before rendering: the held-out records are the same over two epochs, a
restart, a template that writes another date and dp 1 vs 2, and no record is
in both sets. Each epoch of the training rows has its own order (seeded by
``train.seed`` and the epoch), and a resume inside epoch 2 reads the rest of
that epoch exactly as the uninterrupted run.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import ray_fsdp_backend as rfb
from tests import sft_tokenizers as st

SEQ = 128
RECORDS = 40


@pytest.fixture(scope="module")
def ray_session(ray_local):  # the pytest worker's shared cluster
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray_local


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RFB_CACHE_DIR", str(tmp_path / "cache"))


def _name(i: int) -> str:
    """Record ``i``'s name in words (the tiny checkpoint's tokenizer has no digits)."""
    return f"{st.WORDS[i % 12]} {st.WORDS[i // 12]}"


NAMES = {_name(i): i for i in range(RECORDS)}


def _data(tmp_path) -> str:
    path = tmp_path / "train.jsonl"
    with open(path, "w") as f:
        for i in range(RECORDS):
            messages = [
                {"role": "user", "content": f"record {_name(i)}: {st.WORDS[i % 12]}?"},
                {"role": "assistant", "content": st.WORDS[(i * 5) % 12]},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def _dated(day: int):
    """ChatML that writes a date first, as Llama 3.2's template writes today's."""
    tok = st.tokenizer("chatml")
    tok.chat_template = f"Today: 2026-12-0{day}\n" + st.CHATML
    return tok


def _record_ids(tok, rows) -> list[int]:
    """The record of each row (one record a row), in order."""
    ids = []
    for row in rows:
        text = tok.decode(np.asarray(row), skip_special_tokens=False)
        ids.append(NAMES[re.search(r"record ([a-z]+ [a-z]+):", text).group(1)])
    return ids


def _split(path, tok, split: str) -> list[int]:
    ds = rfb.sft_dataset(
        path, tok, seq_len=SEQ, packing=False, eval_fraction=0.25, seed=5, split=split
    )
    return _record_ids(tok, [r["input_ids"] for r in ds.take_all()])


def test_held_out_records_stay_held_out(ray_session, tmp_path):
    path = _data(tmp_path)
    tok = _dated(7)
    held, train = sorted(_split(path, tok, "eval")), sorted(_split(path, tok, "train"))
    assert 0 < len(held) < RECORDS // 2
    assert not set(held) & set(train) and sorted(held + train) == list(range(RECORDS))
    ds = rfb.sft_dataset(
        path, tok, seq_len=SEQ, packing=False, eval_fraction=0.25, seed=5, split="eval"
    )
    epochs = [sorted(_record_ids(tok, [r["input_ids"] for r in ds.take_all()])) for _ in "ab"]
    assert epochs == [held, held]  # two epochs
    assert sorted(_split(path, tok, "eval")) == held  # a restart builds it again
    assert sorted(_split(path, _dated(8), "eval")) == held  # the template's date changed
    halves = ds.split(2)  # dp 2: each rank its half of the same records
    per_rank = [_record_ids(tok, [r["input_ids"] for r in h.take_all()]) for h in halves]
    assert sorted(per_rank[0] + per_rank[1]) == held


def _epoch_orders(path, tok, seed: int, batches: int, state=None) -> list[int]:
    from ray_fsdp_backend.trainer.data.sft_batches import SftBatches

    rows = rfb.sft_dataset(path, tok, seq_len=SEQ, packing=False).random_shuffle(seed=seed)
    reader = SftBatches(rows.iterator(), 2, seq_len=SEQ, seed=seed)
    if state is not None:
        reader.load_state_dict(state)
    return [i for _ in range(batches) for i in _record_ids(tok, reader.next_batch()["input_ids"])]


def test_each_epoch_its_own_order_and_a_resume_reproduces_it(ray_session, tmp_path):
    path, tok = _data(tmp_path), st.tokenizer("chatml")
    per_epoch = RECORDS // 2
    run = _epoch_orders(path, tok, seed=3, batches=2 * per_epoch)
    first, second = run[:RECORDS], run[RECORDS:]
    assert sorted(first) == sorted(second) == list(range(RECORDS))
    assert first != second  # each epoch reshuffled
    assert _epoch_orders(path, tok, seed=3, batches=per_epoch) == first  # a restart: the same
    resumed = _epoch_orders(path, tok, seed=3, batches=5, state={"epoch": 1, "epoch_rows": 10})
    assert resumed == second[10:20]  # resumed in epoch 2 after 5 of its batches


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_tool_call_arguments_through_ray_data_are_the_files_json(ray_session, tmp_path, kind):
    """Argument keys differ across records; Arrow would merge them and fill
    ``null``: the rows Ray Data builds train each record's arguments as written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.unit.test_sft_conversation import ARGUMENTS, TOOL_TEMPLATE, _tool_record

    records = [_tool_record(a) for a in ARGUMENTS]
    path = tmp_path / f"tools.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    tok = st.tokenizer("chatml")
    tok.chat_template = TOOL_TEMPLATE
    rows = rfb.sft_dataset(path, tok, seq_len=512, packing=False).take_all()
    trained = sorted(tok.decode(r["labels"][r["labels"] != -100]) for r in rows)
    want = sorted(
        f"<tool_call>weather {json.dumps(a)}</tool_call><|im_end|>\nSunny.<|im_end|>\n"
        for a in ARGUMENTS
    )
    assert trained == want


def test_the_trainer_holds_out_the_records_the_library_does(ray_session, tmp_path):
    """``data.eval_fraction`` with ``train.seed``: the trainer's two datasets
    hold the library's split of the records (another tokenizer, same records)."""
    from ray_fsdp_backend.hf.metadata import load_tokenizer
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained
    from ray_fsdp_backend.trainer.data.sft import build_sft_datasets
    from ray_fsdp_backend.trainer.schema.spec import build_spec

    model, path = save_tiny_pretrained("llama", tmp_path / "m", chat=True), _data(tmp_path)
    doc = {
        "distributed": {},
        "model": {"pretrained": model, "seq_len": SEQ},
        "data": {"format": "chat", "path": path, "eval_fraction": 0.25},
        "train": {"micro_batch_size": 1, "seed": 5},
        "scaling": {"num_workers": 1},
    }
    datasets = build_sft_datasets(build_spec(doc, torch_config=False))
    tok = load_tokenizer(model)
    got = {
        k: sorted(_record_ids(tok, [r["input_ids"] for r in d.take_all()]))
        for k, d in datasets.items()
    }
    assert got["eval"] == sorted(_split(path, st.tokenizer("chatml"), "eval"))
    assert sorted(got["train"] + got["eval"]) == list(range(RECORDS))
