"""Records as people write them (issue 54, item 3): tool calls whose argument
keys differ across records train exactly the file's JSON from JSON lines and
from parquet (the workers' own reader on the file's bytes); the record's
``tools`` reach the template; ``content: null`` with ``tool_calls``; a role
map, ShareGPT and Alpaca read as the same chat; ``weight: 0`` leaves a turn
untrained; text parts joined."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_fsdp_backend.sft.dataset import records_from_file, rows_from_batch
from ray_fsdp_backend.sft.records import SFTOptions, parse_record
from ray_fsdp_backend.sft.render import render_record
from tests import sft_tokenizers as st

pytest.importorskip("transformers")

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for tc in m['tool_calls'] or [] %}<tool_call>{{ tc['function']['name'] }} "
    "{{ tc['function']['arguments'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARGUMENTS = [{"city": "Paris"}, {"query": "rain", "days": 3}, {"city": "Oslo", "units": "metric"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def _tool_record(args: dict) -> dict:
    call = {"type": "function", "function": {"name": "weather", "arguments": args}}
    return {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "tools": TOOLS,
    }


def _tokenizer():
    tok = st.tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    return tok


def _worker_documents(path: str, kind: str, tok, **options):
    """The workers' functions on the file's bytes: records, then one row each."""
    files = pa.table({"path": [path], "bytes": [open(path, "rb").read()]})
    records = records_from_file(files, kind, None, 0, "train")
    opts = SFTOptions.build(format="chat", seq_len=256, packing=False, **options)
    return rows_from_batch(records, tok, opts)


@pytest.mark.parametrize("kind", ["json", "parquet"])
def test_tool_call_arguments_train_exactly_the_files_json(tmp_path, kind):
    tok = _tokenizer()
    records = [_tool_record(a) for a in ARGUMENTS]
    path = str(tmp_path / f"tools.{'jsonl' if kind == 'json' else 'parquet'}")
    if kind == "json":
        open(path, "w").write("".join(json.dumps(r) + "\n" for r in records))
    else:  # Arrow merges the argument structs: every row gets city, query, days, units
        pq.write_table(pa.Table.from_pylist(records), path)
    rows = _worker_documents(path, kind, tok)
    for args, ids, labels in zip(ARGUMENTS, rows["input_ids"], rows["labels"], strict=True):
        trained = tok.decode(labels[labels != -100])
        assert trained.startswith(f"<tool_call>weather {json.dumps(args)}</tool_call>"), trained
        assert "null" not in tok.decode(ids)
        assert f"TOOLS {json.dumps(TOOLS)}" in tok.decode(ids)  # the tools reach the template
        assert "TOOLS" not in trained


def _targets(record: dict, tok=None, **options) -> str:
    tok = tok or st.tokenizer()
    opts = SFTOptions.build(seq_len=256, **{"format": "chat", **options})
    [(ids, labels)] = render_record(record, tok, opts, "t.jsonl:1")
    return tok.decode(labels[labels != -100]), ids


def test_weight_zero_leaves_a_turn_untrained():
    messages = [dict(m) for m in st.conversations()[0]]
    messages[2]["weight"] = 0
    trained, _ = _targets({"messages": messages})
    assert trained == "Yes: once more.<|im_end|>\n"
    assert _targets({"messages": st.conversations()[0]})[0].startswith("Hello, friend.")


def test_role_map_sharegpt_and_alpaca_read_as_the_same_chat():
    chat = {
        "messages": [
            {"role": "user", "content": "Hi\nthere"},
            {"role": "assistant", "content": "Yo"},
        ]
    }
    want = _targets(chat)
    bot = {
        "messages": [{"role": "human", "content": "Hi\nthere"}, {"role": "bot", "content": "Yo"}]
    }
    roles = {"human": "user", "bot": "assistant"}
    assert _targets(bot, roles=roles)[0] == want[0]
    assert (_targets(bot, roles=roles)[1] == want[1]).all()
    share = {
        "conversations": [{"from": "human", "value": "Hi\nthere"}, {"from": "gpt", "value": "Yo"}]
    }
    assert (_targets(share, format="sharegpt")[1] == want[1]).all()
    alpaca = {"instruction": "Hi", "input": "there", "output": "Yo"}
    assert (_targets(alpaca, format="alpaca")[1] == want[1]).all()


def test_text_parts_are_joined_and_tool_call_turns_need_no_content():
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    record = {
        "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "4"}]
    }
    plain = {"messages": st.conversations()[1]}
    assert np.array_equal(_targets(record)[1], _targets(plain)[1])
    record = _tool_record({"city": "Paris"})
    del record["messages"][1]["content"]
    trained, _ = _targets(record, _tokenizer())
    assert trained.startswith('<tool_call>weather {"city": "Paris"}</tool_call>')


def test_parse_record_names_the_line():
    from ray_fsdp_backend.sft.records import RawRecord, SFTDataError

    with pytest.raises(SFTDataError, match=r"^f\.jsonl:3: not JSON \(Extra data at column 4\)"):
        parse_record(RawRecord("f.jsonl:3", "{} {}"))
