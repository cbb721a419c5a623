"""``rfb.preference_dataset`` on the pytest worker's shared local Ray cluster
(``ray_local``), against the tokenizer alone.

The same pairs as JSON lines (local, two files) and as parquet (on an S3 API
on loopback) give identical rows; the rows read back are every pair once,
equal to the driver's own rendering of its record, its two documents side by
side, ``pair_index`` the record's place; the held-out split takes the same
records whatever the source's layout, and none in both splits."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ray_fsdp_backend as rfb
from ray_fsdp_backend.preference.dataset import ROW_COLUMNS
from ray_fsdp_backend.preference.pairs import PreferenceOptions, read_pair
from ray_fsdp_backend.preference.render import pair_documents
from tests import sft_tokenizers as st

SEQ = 256


@pytest.fixture(scope="module")
def ray_session(s3_server, ray_local):
    """Ray Data as the trainer reads preference data: blocks in order
    (``ingest_options(preserve_order=True)`` in ``ray-fsdp train``), so
    the packed rows do not depend on which read finished first."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    preserve = context.execution_options.preserve_order
    context.execution_options.preserve_order = True
    yield ray_local
    context.execution_options.preserve_order = preserve


def _pairs(n: int) -> list[dict]:
    conversations = st.random_conversations(n, seed=5)
    records = []
    for i, messages in enumerate(conversations):
        prompt = [m for m in messages if m["role"] != "assistant"][:2]
        good = {"role": "assistant", "content": f"answer {i}"}
        bad = {"role": "assistant", "content": f"wrong {i} " * (i % 4 + 1)}
        if i % 2 == 0:
            records.append({"prompt": prompt, "chosen": [good], "rejected": [bad]})
        else:  # implicit prompt
            records.append({"chosen": prompt + [good], "rejected": prompt + [bad]})
    return records


def _rows(ds) -> list[tuple]:
    rows = ds.take_all()
    assert all(len(r[c]) == SEQ for r in rows for c in ROW_COLUMNS)
    return sorted(tuple(tuple(r[c].tolist()) for c in ROW_COLUMNS) for r in rows)


def _by_pair(rows) -> dict[int, list]:
    """``{pair_index: [chosen ids, rejected ids]}`` read back through ``sequence_ids``."""
    found = {}
    for ids, _, _, seq, index in (map(np.asarray, r) for r in rows):
        for s in range(int(seq.max()) + 1):
            at = np.flatnonzero(seq == s)
            assert len(set(index[at].tolist())) == 1
            found.setdefault(int(index[at[0]]), []).append(ids[at].tolist())
    return found


def test_jsonl_and_parquet_on_s3_give_identical_rows(ray_session, tmp_path, s3_server):
    records = _pairs(60)
    for part, chunk in enumerate((records[:25], records[25:])):
        with open(tmp_path / f"part-{part}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in chunk)
    fs = s3_server.filesystem()
    fs.create_dir("pref-data")
    schema = pa.Table.from_pylist(records[:1]).schema  # every field (an implicit prompt: null)
    for name, chunk in (("a", records[:25]), ("b", records[25:])):
        table = pa.Table.from_pylist(chunk, schema=schema)
        pq.write_table(table, f"pref-data/train/{name}.parquet", filesystem=fs)
    tok = st.tokenizer("chatml")
    local = _rows(rfb.preference_dataset(tmp_path, tok, seq_len=SEQ))
    remote = _rows(rfb.preference_dataset("pref-data/train", tok, seq_len=SEQ, filesystem=fs))
    assert local == remote
    options = PreferenceOptions.build(seq_len=SEQ)
    found = _by_pair(local)
    assert sorted(found) == list(range(60))  # every pair once, numbered by its place
    for i, record in enumerate(records):
        pair = read_pair(record, options, "x")
        expected = [d[0].tolist() for d in pair_documents(pair, tok, options, "x")]
        assert found[i] == expected
    assert len(local) < 60  # packed: several pairs a row
    unpacked = _rows(rfb.preference_dataset(tmp_path, tok, seq_len=SEQ, packing=False))
    assert len(unpacked) == 60 and _by_pair(unpacked) == found


def test_the_held_out_pairs_are_a_seeded_fraction_of_the_records(ray_session, tmp_path):
    records = _pairs(80)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    with open(tmp_path / "one" / "all.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    for part, chunk in enumerate((records[:50], records[50:])):
        with open(tmp_path / "two" / f"p{part}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in chunk)
    tok = st.tokenizer("chatml")
    split = {"eval_fraction": 0.25, "seed": 3}
    held = {}
    for layout in ("one", "two"):
        path = tmp_path / layout
        train = _by_pair(_rows(rfb.preference_dataset(path, tok, seq_len=SEQ, **split)))
        evals = _by_pair(
            _rows(rfb.preference_dataset(path, tok, seq_len=SEQ, split="eval", **split))
        )
        assert not set(train) & set(evals) and sorted({*train, *evals}) == list(range(80))
        assert 5 < len(evals) < 40
        held[layout] = sorted(evals)
    assert held["one"] == held["two"]
