"""``rfb.sft_dataset`` on a local Ray cluster against the tokenizer alone.

The pytest worker's shared Ray cluster (``ray_local``). Every row is ``seq_len`` long; the
documents cut out of the rows (by their ``position_ids``) are exactly the
records, each once, each equal to ``apply_chat_template`` of its record, with
targets exactly on its assistant turns; a parquet directory on an S3 API on
loopback reads as a local JSON-lines file does; ``sft_stats`` counts what the
rows hold.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ray_fsdp_backend as rfb
from ray_fsdp_backend.sft.records import SFTOptions
from ray_fsdp_backend.sft.render import render_record
from tests import sft_tokenizers as st
from tests.sft_families import FAMILIES, TEMPLATES, family_tokenizer

SEQ = 512


@pytest.fixture(scope="module")
def ray_session(s3_server, ray_local):  # the pytest worker's shared cluster
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray_local


def _rows(ds) -> dict[str, np.ndarray]:
    rows = ds.take_all()
    return {k: np.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}


def _documents(rows):
    """``(input_ids, labels)`` of every document in the rows, padding included."""
    docs = []
    for ids, labels, positions in zip(*rows.values(), strict=True):
        starts = np.flatnonzero(positions == 0).tolist() + [len(positions)]
        docs += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:], strict=False)]
    return docs


def _check_chat_rows(rows, conversations, template, pad_id):
    tok = st.tokenizer(template)
    assert all(v.shape[1] == SEQ for v in rows.values())
    references = {tuple(st.reference_ids(tok, m)): m for m in conversations}
    seen = []
    for ids, labels in _documents(rows):
        if (ids == pad_id).all() and (labels == -100).all():
            continue  # padding
        messages = references[tuple(ids.tolist())]  # KeyError: not a record's tokens
        seen.append(tuple(ids.tolist()))
        runs = [
            tok(m["content"] + st.TURN_END[template], add_special_tokens=False)["input_ids"]
            for m in messages
            if m["role"] == "assistant"
        ]
        targets = [t for t in labels.tolist() if t != -100]
        assert targets == [t for run in runs for t in run]
        assert labels[0] == -100
        assert ((labels == ids) | (labels == -100)).all()
    assert sorted(seen) == sorted(references)  # every record exactly once


def test_chat_jsonl_directory_packed(ray_session, tmp_path):
    conversations = st.random_conversations(300, seed=1)
    for part in range(2):
        with open(tmp_path / f"part-{part}.jsonl", "w") as f:
            for messages in conversations[part::2]:
                f.write(json.dumps({"messages": messages, "id": 1}) + "\n")
    tok = st.tokenizer("chatml")
    rows = _rows(rfb.sft_dataset(tmp_path, tok, seq_len=SEQ))
    _check_chat_rows(rows, conversations, "chatml", tok.pad_token_id)
    stats = rfb.sft_stats(tmp_path, tok, format="chat", seq_len=SEQ)
    assert stats["records"] == stats["documents"] == 300
    assert stats["rows"] == len(rows["input_ids"])
    assert stats["targets"] == int((rows["labels"] != -100).sum())
    assert stats["padding_fraction"] < 0.05, stats


def test_chat_parquet_on_s3_unpacked(ray_session, s3_server):
    fs = s3_server.filesystem()
    fs.create_dir("sft-data")
    conversations = st.random_conversations(40, seed=2)
    table = pa.Table.from_pylist([{"conv": m} for m in conversations])
    pq.write_table(table, "sft-data/train/a.parquet", filesystem=fs, row_group_size=16)
    tok = st.tokenizer("llama3")
    ds = rfb.sft_dataset(
        "sft-data/train", tok, seq_len=SEQ, packing=False, messages_field="conv", filesystem=fs
    )
    rows = _rows(ds)
    assert len(rows["input_ids"]) == 40  # one record a row
    _check_chat_rows(rows, conversations, "llama3", tok.pad_token_id)


def test_text_records_split_and_prompt_completion(ray_session, tmp_path):
    tok = st.tokenizer(None)
    long_text = " ".join(st.WORDS * 60)
    pq.write_table(
        pa.Table.from_pylist([{"text": long_text}, {"text": "short one"}]), tmp_path / "t.parquet"
    )
    rows = _rows(rfb.sft_dataset(tmp_path / "t.parquet", tok, format="text", seq_len=64))
    tokens = [ids for ids, labels in _documents(rows) if (labels != -100).any()]
    expected = tok(long_text)["input_ids"] + [tok.eos_token_id]
    long_pieces = [expected[a : a + 64] for a in range(0, len(expected), 64)]
    short = tok("short one")["input_ids"] + [tok.eos_token_id]
    assert sorted(t.tolist() for t in tokens) == sorted([*long_pieces, short])
    pc = tmp_path / "pc.jsonl"
    pc.write_text(json.dumps({"prompt": "Q: 1+1=", "completion": " 2"}) + "\n")
    rows = _rows(rfb.sft_dataset(pc, tok, format="prompt_completion", seq_len=16))
    targets = [t for t in rows["labels"][0].tolist() if t != -100]
    assert tok.decode(targets) == " 2<eos>"


def _family_records() -> list[list[dict]]:
    """Conversations whose first answer renders apart under Qwen3 (history
    reasoning dropped) and Mistral v0.3 (the system prompt moves)."""
    think = "<think>\nadd\n</think>\n\n"
    return [
        [
            {"role": "system", "content": f"rule {i}"},
            {"role": "user", "content": f"#{i} 2+2?"},
            {"role": "assistant", "content": think + "4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": think + "6" * (1 + i % 3)},
        ]
        for i in range(12)
    ]


@pytest.mark.parametrize("family", ["qwen3", "mistral_v0_3"])
def test_family_templates_through_ray_data_from_jsonl_and_parquet(ray_session, tmp_path, family):
    """The rows of a JSONL file and of the same records in parquet (Arrow
    adds null keys) hold exactly the documents of :func:`render_record`:
    the whole conversations and the turns rendered apart, each once; the
    template given as ``chat_template`` (a file) over a ChatML tokenizer."""
    records = _family_records()
    tok = family_tokenizer(family)
    template = str(TEMPLATES / f"{FAMILIES[family].template}.jinja")
    options = SFTOptions.build(format="chat", seq_len=SEQ, chat_template=template)
    expected = sorted(
        (tuple(ids.tolist()), tuple(labels[1:].tolist()))
        for m in records
        for ids, labels in render_record({"messages": m}, tok, options, "r")
    )
    assert len(expected) == 2 * len(records)  # every first answer apart
    tok.chat_template = st.CHATML  # the file renders, not the tokenizer's template
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    pq.write_table(pa.Table.from_pylist([{"messages": m} for m in records]), tmp_path / "b.parquet")
    for path in (tmp_path / "a.jsonl", tmp_path / "b.parquet"):
        rows = _rows(rfb.sft_dataset(path, tok, seq_len=SEQ, chat_template=template))
        documents = [
            (tuple(ids.tolist()), tuple(labels[1:].tolist()))
            for ids, labels in _documents(rows)
            if not (labels == -100).all()
        ]
        assert sorted(documents) == expected


def test_a_small_datasets_rows_are_built_once_for_every_epoch(ray_session, tmp_path):
    """``ray-fsdp train``'s SFT datasets: the training rows of a small record
    set are materialised (an epoch reads the object store, not the records),
    a set above the bound streams from the records each epoch."""
    import ray.data
    from ray.data.dataset import MaterializedDataset

    from ray_fsdp_backend.cli.main import build_datasets
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_chat_data, save_tiny_pretrained
    from ray_fsdp_backend.trainer.data.sft import build_sft_datasets, records_bytes
    from ray_fsdp_backend.trainer.schema.spec import build_spec

    model = save_tiny_pretrained("llama", tmp_path / "chat", chat=True)
    files = save_tiny_chat_data(tmp_path / "data")
    doc = {
        "distributed": {"use_mixed_precision": False},
        "model": {"pretrained": model, "seq_len": 128},
        "data": {"format": "chat", "path": files["train"], "packing": True},
    }
    spec = build_spec(doc, torch_config=False)
    context = ray.data.DataContext.get_current()
    context.print_on_execution_start = True  # Ray 2.60's default
    small = build_datasets(spec)["train"]  # what ray-fsdp train builds
    # each epoch's execution of the split prints no "Starting execution" /
    # "Execution plan" lines (the quiet console of docs/monitoring.md)
    assert context.print_on_execution_start is False
    assert isinstance(small, MaterializedDataset) and small.count() > 0
    size = records_bytes(files["train"])
    large = build_sft_datasets(spec, small_bytes=size - 1)["train"]
    assert not isinstance(large, MaterializedDataset)
    assert sorted(map(repr, large.take_all())) == sorted(map(repr, small.take_all()))
