"""Bad input is refused on the driver, naming the file and the record, before
any Ray work (``check_sft_source``; ``sft_dataset`` calls it first)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_fsdp_backend.sft import SFTDataError, check_sft_source
from tests import sft_tokenizers as st

GOOD = {"messages": st.conversations()[1]}


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _check(path, template="chatml", **kwargs):
    kwargs.setdefault("seq_len", 64)
    return check_sft_source(path, st.tokenizer(template), **kwargs)


def test_a_good_file_a_directory_and_parquet_pass(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [GOOD] * 3)
    pq.write_table(pa.Table.from_pylist([GOOD] * 2), tmp_path / "b.parquet")
    assert _check(tmp_path / "a.jsonl").source.kind == "json"
    assert _check(tmp_path / "b.parquet").source.kind == "parquet"
    (tmp_path / "dir").mkdir()
    _jsonl(tmp_path / "dir" / "x.jsonl", [GOOD])
    (tmp_path / "dir" / "_SUCCESS").write_text("")
    assert len(_check(tmp_path / "dir").source.files) == 1


def test_missing_field_names_the_file_and_the_record(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [GOOD, GOOD, {"conversation": []}])
    with pytest.raises(SFTDataError, match=r"a\.jsonl:3: field 'messages' is missing"):
        _check(path)
    with pytest.raises(SFTDataError, match=r"p\.jsonl:1: field 'completion' is missing"):
        _check(_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}]), format="prompt_completion")


def test_a_role_the_template_refuses(tmp_path):
    bad = {"messages": [{"role": "tool", "content": "42"}, *GOOD["messages"]]}
    path = _jsonl(tmp_path / "a.jsonl", [GOOD, bad])
    with pytest.raises(SFTDataError, match=r"a\.jsonl:2: the chat template refuses.*tool"):
        _check(path, template="default_system")


def test_a_message_without_role_or_content(tmp_path):
    bad = {"messages": [{"role": "user"}]}
    match = r"a\.jsonl:1: message 0 \(role 'user'\) has no 'content'"
    with pytest.raises(SFTDataError, match=match):
        _check(_jsonl(tmp_path / "a.jsonl", [bad]))


def test_no_chat_template_under_format_chat(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [GOOD])
    with pytest.raises(SFTDataError, match="format 'chat' needs a tokenizer with a chat_template"):
        _check(path, template=None)
    pc = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "completion": "b"}])
    _check(pc, template=None, format="prompt_completion")


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SFTDataError, match="holds no record"):
        _check(tmp_path / "empty.jsonl")
    (tmp_path / "d").mkdir()
    with pytest.raises(SFTDataError, match="is an empty directory"):
        _check(tmp_path / "d")
    with pytest.raises(SFTDataError, match="does not exist"):
        _check(tmp_path / "nothing.jsonl")


def test_files_that_are_not_json_lines_or_parquet(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(GOOD) + "\nnot json at all\n")
    with pytest.raises(SFTDataError, match=r"a\.jsonl:2: not JSON"):
        _check(tmp_path / "a.jsonl")
    (tmp_path / "array.json").write_text(json.dumps([GOOD, GOOD]))
    with pytest.raises(SFTDataError, match=r"array\.json:1: a JSON list, not an object"):
        _check(tmp_path / "array.json")
    (tmp_path / "fake.parquet").write_text(json.dumps(GOOD))
    with pytest.raises(SFTDataError, match=r"fake\.parquet: is not a parquet file"):
        _check(tmp_path / "fake.parquet")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(SFTDataError, match=r"notes\.txt' is neither JSON lines"):
        _check(tmp_path / "notes.txt")


def test_a_directory_mixing_kinds(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [GOOD])
    pq.write_table(pa.Table.from_pylist([GOOD]), tmp_path / "b.parquet")
    with pytest.raises(SFTDataError, match="mixes JSON lines"):
        _check(tmp_path)


def test_bad_options():
    with pytest.raises(ValueError, match="format='jsonl' is not one of chat, prompt_completion"):
        _check("unused", format="jsonl")
    with pytest.raises(ValueError, match="seq_len=1 must be an int >= 2"):
        _check("unused", seq_len=1)
