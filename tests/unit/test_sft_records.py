"""Every record is checked on the driver before Ray starts (issue 54, item 1):
a bad record at record 25 of 40 (past the 16 the old check read) is named
``FILE:LINE`` (``FILE#ROW``) with its reason by ``validate``; a long list is cut
with a count; the counts match what the workers' functions make; too few rows
for one micro-batch per dp rank is refused with the numbers; the check is
cached by the files' content."""

from __future__ import annotations

import json
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_fsdp_backend.sft import SFTDataError, check_sft_source
from ray_fsdp_backend.trainer.schema.spec import check_spec
from tests import sft_tokenizers as st

pytest.importorskip("transformers")

USER = {"role": "user", "content": "What is 2+2?"}
ANSWER = {"role": "assistant", "content": "4"}
BAD = {
    "not JSON": ('{"messages": [', "not JSON"),
    "missing field": ({"conversation": [USER, ANSWER]}, "field 'messages' is missing"),
    "list content": ({"messages": [USER, {"role": "assistant", "content": ["a", "b"]}]}, "part 0"),
    "int content": ({"messages": [USER, {"role": "assistant", "content": 42}]}, "content is a int"),
    "role typo": ({"messages": [USER, {"role": "bot", "content": "4"}]}, "has role 'bot'"),
    "no assistant": ({"messages": [USER]}, "no trainable token"),
    "image part": (
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}, ANSWER]},
        "is an 'image' part",
    ),
}


def _good(i: int) -> dict:
    return {"messages": st.conversations()[i % 3]}


def _write_jsonl(path, records) -> str:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _forty(bad, at: int = 24) -> list:
    return [bad if i == at else _good(i) for i in range(40)]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    return save_tiny_pretrained("llama", tmp_path_factory.mktemp("m") / "chat", chat=True)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RFB_CACHE_DIR", str(tmp_path / "cache"))


def _validate(model: str, path: str, seq_len: int = 128, train=None, **data) -> list[str]:
    doc = {
        "distributed": {},
        "model": {"pretrained": model, "seq_len": seq_len},
        "data": {"format": "chat", "path": path, "packing": True, **data},
        "train": train or {"micro_batch_size": 1},
        "scaling": {"num_workers": 1},
    }
    return check_spec(doc)


@pytest.mark.parametrize("case", list(BAD))
def test_validate_names_record_25_of_40_and_its_reason_without_ray(chat_model, tmp_path, case):
    record, reason = BAD[case]
    path = _write_jsonl(tmp_path / "train.jsonl", _forty(record))
    start = time.perf_counter()
    errors = _validate(chat_model, path)
    assert time.perf_counter() - start < 10
    assert len(errors) == 1 and f"{path}:25: " in errors[0] and reason in errors[0], errors
    assert "1 record(s)" in errors[0]
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.mark.parametrize("case", ["missing field", "role typo"])
def test_parquet_names_the_row(chat_model, tmp_path, case):
    record, reason = BAD[case]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_forty(record)), path)
    errors = _validate(chat_model, path)
    assert len(errors) == 1 and f"{path}#24: " in errors[0] and reason in errors[0], errors


def test_a_template_refusal_is_named(tmp_path):
    bad = {"messages": [{"role": "tool", "content": "42"}, USER, ANSWER]}
    path = _write_jsonl(tmp_path / "a.jsonl", _forty(bad))
    with pytest.raises(SFTDataError, match=r"a\.jsonl:25: the chat template refuses"):
        check_sft_source(path, st.tokenizer("default_system"), seq_len=128)


def test_many_problems_are_cut_with_a_count_and_the_counts_follow(tmp_path):
    records = [BAD["role typo"][0] if i % 2 else _good(i) for i in range(60)]
    path = _write_jsonl(tmp_path / "a.jsonl", records)
    with pytest.raises(SFTDataError) as info:
        check_sft_source(path, st.tokenizer(), seq_len=128)
    message = str(info.value)
    assert message.startswith(f"30 record(s) of {path} cannot be trained as written")
    assert message.count("has role 'bot'") == 20 and "... and 10 more problem record(s)" in message
    assert "60 records read, 30 refused; train: 30 records, 30 rendered" in message


def test_counts_match_what_the_workers_functions_make(tmp_path):
    from ray_fsdp_backend.sft.dataset import records_from_file, rows_from_batch
    from ray_fsdp_backend.sft.packing import PackCounts
    from ray_fsdp_backend.sft.records import SFTOptions

    records = [_good(i) for i in range(40)]
    records[7] = {"messages": [USER, {"role": "assistant", "content": "word " * 400}]}
    path = _write_jsonl(tmp_path / "a.jsonl", records)
    tok = st.tokenizer()
    checked = check_sft_source(path, tok, seq_len=256)
    files = pa.table({"path": [path], "bytes": [open(path, "rb").read()]})
    batch = records_from_file(files, "json", None, 0, "train")
    counts = PackCounts()
    rows_from_batch(batch, tok, SFTOptions.build(format="chat", seq_len=256), counts)
    assert checked.counts["train"] == counts.as_dict()
    assert counts.records == 40 and counts.truncated == 1 and counts.rows > 0


def test_too_few_rows_for_one_micro_batch_per_rank_is_refused_with_the_numbers(
    chat_model, tmp_path
):
    path = _write_jsonl(tmp_path / "small.jsonl", [_good(i) for i in range(30)])
    train = {"micro_batch_size": 8}
    errors = _validate(chat_model, path, seq_len=512, train=train, eval_fraction=0.1)
    assert len(errors) == 1, errors
    assert "training row(s)" in errors[0] and "train.micro_batch_size=8" in errors[0], errors
    assert "after data.eval_fraction=0.1" in errors[0] and "give at least 8 rows" in errors[0]
    assert _validate(chat_model, path, seq_len=512, train={"micro_batch_size": 1}) == []


def test_the_check_is_cached_by_content(tmp_path, monkeypatch):
    import ray_fsdp_backend.sft.dataset as dataset

    calls = []
    real = dataset.check_records
    monkeypatch.setattr(dataset, "check_records", lambda *a: calls.append(1) or real(*a))
    path = _write_jsonl(tmp_path / "a.jsonl", [_good(i) for i in range(10)])
    first = check_sft_source(path, st.tokenizer(), seq_len=64)
    again = check_sft_source(path, st.tokenizer(), seq_len=64)
    assert len(calls) == 1 and again.counts == first.counts
    check_sft_source(path, st.tokenizer("llama3"), seq_len=64)  # another template
    assert len(calls) == 2
    _write_jsonl(tmp_path / "a.jsonl", [_good(i) for i in range(9)] + [BAD["role typo"][0]])
    with pytest.raises(SFTDataError, match=r"a\.jsonl:10: message 1 has role 'bot'"):
        check_sft_source(path, st.tokenizer(), seq_len=64)
    with pytest.raises(SFTDataError, match=r"a\.jsonl:10: "):  # the refusal is cached too
        check_sft_source(path, st.tokenizer(), seq_len=64)
    assert len(calls) == 3


def test_validate_and_train_commands_refuse_record_25_before_ray(chat_model, tmp_path):
    """The commands themselves, in a fresh interpreter: the error names the
    line, and neither command has imported Ray when it refuses."""
    import os
    import subprocess

    data = _write_jsonl(tmp_path / "train.jsonl", _forty(BAD["role typo"][0]))
    config = tmp_path / "sft.yaml"
    config.write_text(
        "distributed: {}\n"
        f"model: {{pretrained: {chat_model}, seq_len: 128}}\n"
        f"data: {{format: chat, path: {data}, packing: true}}\n"
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
        assert f"{data}:25: message 1 has role 'bot'" in out.stdout + out.stderr, out
        assert "ray imported: False" in out.stdout, out.stdout


def test_row_errors_count_rows_per_rank_at_the_largest_worker_count():
    from ray_fsdp_backend.trainer.schema.options import DataOptions, ScalingOptions, TrainOptions
    from ray_fsdp_backend.trainer.schema.sft import row_errors

    data = DataOptions(format="chat", path="d.jsonl")
    train = TrainOptions(micro_batch_size=4)
    elastic = ScalingOptions(num_workers=[2, 4])
    assert row_errors(data, {"train": 16}, train, elastic, 1) == []
    errors = row_errors(data, {"train": 15}, train, elastic, 1)
    assert len(errors) == 1 and "3 per data-parallel rank at 4 rank(s)" in errors[0], errors
    assert row_errors(data, {"train": 8}, train, elastic, 2) == []  # tp 2: 2 dp ranks
    gbs = TrainOptions(micro_batch_size=8, global_batch_size=8)  # 2 per rank at 4 ranks
    assert row_errors(data, {"train": 8}, gbs, elastic, 1) == []
    assert (
        "held-out set has no row"
        in row_errors(data, {"train": 99, "eval": 0}, train, elastic, 1)[0]
    )


def _phi3_multi(i: int) -> dict:
    """Two exchanges: Phi-3 writes EOS only at the very end, so the first
    answer renders apart (a document of its own)."""
    user, answer = {"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hi."}
    again = {"role": "user", "content": "Again?"}
    return {"messages": [user, answer, again, dict(ANSWER)]}  # a copy: tests set its weight


def test_a_record_of_several_documents_counts_once_as_a_record(tmp_path):
    """The check and the workers' function count records and documents alike
    when a template renders a history turn apart (two documents a record)."""
    from ray_fsdp_backend.sft.dataset import records_from_file, rows_from_batch
    from ray_fsdp_backend.sft.packing import PackCounts
    from ray_fsdp_backend.sft.records import SFTOptions
    from tests.sft_families import family_tokenizer

    path = _write_jsonl(tmp_path / "a.jsonl", [_phi3_multi(i) for i in range(12)])
    tok = family_tokenizer("phi3")
    checked = check_sft_source(path, tok, seq_len=256)
    files = pa.table({"path": [path], "bytes": [open(path, "rb").read()]})
    counts = PackCounts()
    batch = records_from_file(files, "json", None, 0, "train")
    rows_from_batch(batch, tok, SFTOptions.build(format="chat", seq_len=256), counts)
    assert checked.counts["train"] == counts.as_dict()
    assert (counts.records, counts.documents) == (12, 24)
    assert "12 records read, 0 refused; train: 12 records, 24 rendered" in checked.summary()


def test_weight_zero_leaves_a_turn_rendered_apart_untrained(tmp_path):
    """Phi-3's first answer renders apart; with weight 0 it is no document at
    all, and a record whose every answer has weight 0 is refused by the check."""
    from ray_fsdp_backend.sft.records import SFTOptions
    from ray_fsdp_backend.sft.render import render_record
    from tests.sft_families import family_tokenizer

    tok = family_tokenizer("phi3")
    options = SFTOptions.build(format="chat", seq_len=256)
    record = _phi3_multi(0)
    assert len(render_record(record, tok, options, "r")) == 2
    record["messages"][1]["weight"] = 0
    [(ids, labels)] = render_record(record, tok, options, "r")
    assert tok.decode(labels[labels != -100]) == "4<|end|>\n<|endoftext|>"
    record["messages"][3]["weight"] = 0
    path = _write_jsonl(tmp_path / "a.jsonl", [_phi3_multi(i) for i in range(3)] + [record])
    with pytest.raises(SFTDataError, match=r"a\.jsonl:4: no trainable token"):
        check_sft_source(path, tok, seq_len=256)


def test_the_check_cache_covers_chat_template_and_its_kwargs(tmp_path, monkeypatch):
    """A template file whose text changes, or other template kwargs, is a new key."""
    import ray_fsdp_backend.sft.dataset as dataset

    calls = []
    real = dataset.check_records
    monkeypatch.setattr(dataset, "check_records", lambda *a: calls.append(1) or real(*a))
    path = _write_jsonl(tmp_path / "a.jsonl", [_good(i) for i in range(10)])
    template = tmp_path / "t.jinja"
    template.write_text(st.CHATML)
    for _ in range(2):
        check_sft_source(path, st.tokenizer(), seq_len=64, chat_template=str(template))
    assert len(calls) == 1
    template.write_text(st.CHATML.replace("<|im_start|>", "<|im_start|> "))
    check_sft_source(path, st.tokenizer(), seq_len=64, chat_template=str(template))
    assert len(calls) == 2
    kwargs = {"enable_thinking": False}
    check_sft_source(
        path, st.tokenizer(), seq_len=64, chat_template=str(template), chat_template_kwargs=kwargs
    )
    assert len(calls) == 3


def test_validate_prints_the_counts_of_a_valid_sft_config(chat_model, tmp_path, capsys):
    """``ray-fsdp validate`` on a valid SFT config prints, under OK, each
    file's records read, rendered, truncated, dropped (by reason), rows and
    padding: here one record a row (no packing), counted by hand from the
    tokenizer's own rendering."""
    from transformers import AutoTokenizer

    from ray_fsdp_backend.cli.main import main

    seq = 128
    long_answer = {"role": "assistant", "content": " ".join(["four"] * 60)}
    long_prompt = {"role": "user", "content": " ".join(["what"] * 60)}
    records = [_good(0), _good(1), {"messages": [USER, long_answer]}]
    records += [{"messages": [long_prompt, ANSWER]}]  # its answer past seq_len: dropped
    data = _write_jsonl(tmp_path / "a.jsonl", records)
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"distributed: {{}}\nmodel: {{pretrained: {chat_model}, seq_len: {seq}}}\n"
        f"data: {{format: chat, path: {data}, packing: false}}\n"
        "train: {steps: 1, micro_batch_size: 1}\nscaling: {num_workers: 1}\n"
    )
    tok = AutoTokenizer.from_pretrained(chat_model)
    rendered = [tok.apply_chat_template(r["messages"], return_dict=True) for r in records]
    lengths = [len(r["input_ids"]) for r in rendered]
    assert lengths[0] < seq and lengths[1] < seq and lengths[2] > seq and lengths[3] > seq
    padding = (seq - lengths[0]) + (seq - lengths[1])  # the truncated row is full

    code = main(["validate", str(config)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0] == f"{config}: OK", out
    assert out.splitlines()[1] == (
        "  data.path: 4 records read, 0 refused; train: 4 records, 3 rendered, "
        "2 truncated to seq_len, 1 dropped (no target left within seq_len), 3 rows, "
        f"{padding} padding tokens"
    ), out


def test_the_driver_hashes_the_record_files_once_per_process(chat_model, tmp_path):
    """``train`` checks the records three times on the driver (the config's
    check, then ``rfb.sft_dataset`` for the training and the held-out
    split): the files are read to hash them once while they stay the same,
    and again once they change."""
    from ray_fsdp_backend.sft.check_cache import STATS

    path = _write_jsonl(tmp_path / "a.jsonl", [_good(i) for i in range(12)])
    before = STATS["files_hashed"]
    assert _validate(chat_model, path, eval_fraction=0.25) == []  # the config's check
    tok = st.tokenizer()
    for _ in ("train", "eval"):  # what build_sft_datasets' two sft_dataset calls check
        check_sft_source(path, tok, seq_len=128, eval_fraction=0.25, seed=0)
    assert STATS["files_hashed"] == before + 1
    _write_jsonl(tmp_path / "a.jsonl", [_good(i) for i in range(13)])
    check_sft_source(path, tok, seq_len=128, eval_fraction=0.25, seed=0)
    assert STATS["files_hashed"] == before + 2
