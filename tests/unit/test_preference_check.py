"""Every preference record is checked on the driver before Ray starts (issue
56, item 1): each bad pair placed at record 25 of 40 is named ``FILE:LINE``
(``FILE#ROW``) with its reason by ``validate`` in under 10 s without Ray; the
commands refuse it before importing Ray; the counts match what the workers'
functions make; ``pair_index`` numbers the records across files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_fsdp_backend.preference.dataset import check_preference_source, rows_from_batch
from ray_fsdp_backend.preference.packing import PairCounts
from ray_fsdp_backend.preference.pairs import PreferenceOptions
from ray_fsdp_backend.sft.records import SFTDataError
from ray_fsdp_backend.trainer.schema.spec import check_spec
from tests import sft_tokenizers as st

pytest.importorskip("transformers")


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


LONG = " ".join(["word"] * 200)
BAD = {
    "not JSON": ('{"prompt": [', "not JSON"),
    "missing rejected": (
        {"prompt": [_user("1+1?")], "chosen": [_assistant("2")]},
        "field 'rejected' is missing",
    ),
    "identical": (
        {"prompt": [_user("1+1?")], "chosen": [_assistant("2")], "rejected": [_assistant("2")]},
        "are the same response",
    ),
    "implicit prompts differ": (
        {"chosen": [_user("1+1?"), _assistant("2")], "rejected": [_user("1+2?"), _assistant("4")]},
        "share no first message, so their prompts differ",
    ),
    "explicit prompt differs": (
        {
            "prompt": [_user("1+1?")],
            "chosen": [_user("1+1?"), _assistant("2")],
            "rejected": [_user("2+2?"), _assistant("3")],
        },
        "'rejected' starts with a 'user' message but does not start with",
    ),
    "no trainable token": (
        {
            "prompt": [_user("1+1?")],
            "chosen": [_assistant("2", weight=0)],
            "rejected": [_assistant("3")],
        },
        "'chosen' response has no trainable token",
    ),
    "cannot fit": (
        {"prompt": [_user(LONG)], "chosen": [_assistant("2")], "rejected": [_assistant("3")]},
        "cannot fit seq_len=128 even with its responses cut",
    ),
}


def _good(i: int) -> dict:
    prompt = [_user(f"What is {i} + {i}?")]
    if i % 3 == 0:  # implicit prompt
        return {"chosen": prompt + [_assistant(str(2 * i))], "rejected": prompt + [_assistant("7")]}
    if i % 3 == 1:
        return {"prompt": prompt, "chosen": [_assistant(str(2 * i))], "rejected": [_assistant("x")]}
    return {"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}


def _forty(bad, at: int = 24) -> list:
    return [bad if i == at else _good(i) for i in range(40)]


def _write_jsonl(path, records) -> str:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    return save_tiny_pretrained("llama", tmp_path_factory.mktemp("m") / "chat", chat=True)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RFB_CACHE_DIR", str(tmp_path / "cache"))


def _validate(model: str, path: str, **data) -> list[str]:
    doc = {
        "distributed": {},
        "model": {"pretrained": model, "seq_len": 128},
        "data": {"format": "preference", "path": path, "packing": True, **data},
        "train": {"micro_batch_size": 1},
        "scaling": {"num_workers": 1},
    }
    return check_spec(doc)


def test_good_pairs_pass(chat_model, tmp_path):
    assert _validate(chat_model, _write_jsonl(tmp_path / "a.jsonl", _forty(_good(3)))) == []


@pytest.mark.parametrize("case", list(BAD))
def test_validate_names_record_25_of_40_and_its_reason_without_ray(chat_model, tmp_path, case):
    record, reason = BAD[case]
    path = _write_jsonl(tmp_path / "train.jsonl", _forty(record))
    start = time.perf_counter()
    errors = _validate(chat_model, path)
    assert time.perf_counter() - start < 10
    assert len(errors) == 1 and f"{path}:25: " in errors[0] and reason in errors[0], errors
    assert "1 record(s)" in errors[0] and "40 pairs read, 1 refused" in errors[0]
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.mark.parametrize("case", ["missing rejected", "implicit prompts differ"])
def test_parquet_names_the_row(chat_model, tmp_path, case):
    record, reason = BAD[case]
    path = str(tmp_path / "train.parquet")
    # a parquet column holds one type: the conversational records only
    records = [r for r in _forty(record) if isinstance(r.get("chosen"), list)]
    pq.write_table(pa.Table.from_pylist(records), path)
    at = records.index(record)
    errors = _validate(chat_model, path)
    assert len(errors) == 1 and f"{path}#{at}: " in errors[0] and reason in errors[0], errors


def test_validate_and_train_commands_refuse_record_25_before_ray(chat_model, tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", _forty(BAD["identical"][0]))
    config = tmp_path / "dpo.yaml"
    config.write_text(
        "distributed: {}\n"
        f"model: {{pretrained: {chat_model}, seq_len: 128}}\n"
        f"data: {{format: preference, path: {data}, packing: true}}\n"
        "train: {steps: 1, micro_batch_size: 1}\nscaling: {num_workers: 1}\n"
    )
    probe = (
        "import sys; from ray_fsdp_backend.cli.main import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept ValueError as exc:\n"
        "    print(exc); code = 3\n"
        "print('ray imported:', 'ray' in sys.modules); sys.exit(code)"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RFB_CACHE_DIR": str(tmp_path / "c")}
    for command in ("validate", "train"):
        out = subprocess.run(
            [sys.executable, "-c", probe, command, str(config)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode != 0, out.stdout + out.stderr
        assert f"{data}:25: 'chosen' and 'rejected' are the same" in out.stdout + out.stderr, out
        assert "ray imported: False" in out.stdout, out.stdout


def test_counts_match_what_the_workers_functions_make(tmp_path):
    tok = st.tokenizer("chatml")
    path = _write_jsonl(tmp_path / "a.jsonl", _forty(_good(3)))
    checked = check_preference_source(path, tok, seq_len=96)
    options = PreferenceOptions.build(seq_len=96)
    texts = (tmp_path / "a.jsonl").read_text().splitlines()
    batch = pa.table(
        {
            "where": [f"{path}:{i + 1}" for i in range(40)],
            "text": texts,
            "index": list(range(40)),
        }
    )
    counts = PairCounts()
    rows = rows_from_batch(batch, tok, options, counts)
    assert checked.counts["train"] == counts.as_dict()
    assert counts.rows == len(rows["input_ids"]) < 40 and counts.pairs == 40


def test_pair_index_numbers_records_across_sorted_files(tmp_path):
    tok = st.tokenizer("chatml")
    (tmp_path / "d").mkdir()
    _write_jsonl(tmp_path / "d" / "b.jsonl", [_good(i) for i in range(5)])
    _write_jsonl(tmp_path / "d" / "a.jsonl", [_good(i) for i in range(3)])
    checked = check_preference_source(str(tmp_path / "d"), tok, seq_len=96)
    offsets = checked.offsets()
    assert list(offsets.values()) == [0, 3] and list(offsets)[0].endswith("a.jsonl")


def test_a_long_list_is_cut_and_options_are_checked(tmp_path):
    tok = st.tokenizer("chatml")
    path = _write_jsonl(tmp_path / "a.jsonl", ["{"] * 30)
    with pytest.raises(SFTDataError, match="and 10 more problem"):
        check_preference_source(path, tok, seq_len=96)
    with pytest.raises(ValueError, match="seq_len=2 must be an int >= 4"):
        check_preference_source(path, tok, seq_len=2)


@pytest.mark.parametrize("name, fmt", [("pairs.jsonl", "chat"), ("pairs.parquet", "text")])
def test_the_example_pairs_pass_the_check(chat_model, tmp_path, name, fmt):
    from ray_fsdp_backend.hf.metadata import load_tokenizer
    from ray_fsdp_backend.preference.make_pairs import main, make_pairs
    from ray_fsdp_backend.preference.pairs import read_pair
    from ray_fsdp_backend.preference.render import pair_documents

    path = str(tmp_path / name)
    main([path, "--count", "200", "--format", fmt])
    tok = load_tokenizer(chat_model)
    checked = check_preference_source(path, tok, seq_len=256)
    counts = checked.counts["train"]
    assert checked.read == counts["records"] == counts["pairs"] == 200
    assert counts["truncated"] == 0 and counts["rows"] <= 70
    # the tiny tokenizer reads every answer (no <unk>), and the two apart
    options = PreferenceOptions.build(seq_len=256)
    for record in make_pairs(40, format=fmt):
        chosen, rejected = pair_documents(read_pair(record, options, "x"), tok, options, "x")
        assert tok.unk_token_id not in chosen[0].tolist() + rejected[0].tolist()
        assert chosen[0].tolist() != rejected[0].tolist()
