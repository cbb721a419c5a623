"""The template table: what each family's real chat template trains
(docs/sft-rows.md, "What each family trains").

For every family, records with a system prompt, single- and multi-turn, with
a tool call and with reasoning where the template renders them: each
document's tokens equal ``apply_chat_template`` of the conversation it holds
(the record, or the record up to one turn) under the documented template,
and its targets, decoded run by run, equal the strings written out below by
hand from the family's format (the independent reference).
"""

from __future__ import annotations

import pytest

from ray_fsdp_backend.sft.records import SFTDataError, SFTOptions
from ray_fsdp_backend.sft.render import render_record
from ray_fsdp_backend.sft.templates import training_template
from tests.sft_families import FAMILIES, family_tokenizer, template_text

SYSTEM = {"role": "system", "content": "Be brief."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def _call(arguments, content=None):
    function = {"name": "get_weather", "arguments": arguments}
    return _assistant(
        content, tool_calls=[{"type": "function", "id": "call00001", "function": function}]
    )


TOOL_RESULT = {
    "role": "tool",
    "tool_call_id": "call00001",
    "name": "get_weather",
    "content": "18 C",
}
SINGLE = [SYSTEM, _user("What is 2+2?"), _assistant("4")]
MULTI = [SYSTEM, _user("Hi there"), _assistant("Hello."), _user("Again?"), _assistant("Once more.")]
TOOL = [SYSTEM, _user("Weather in Paris?"), _call({"city": "Paris"}), TOOL_RESULT]
TOOL += [_assistant("18 C in Paris.")]
TOOL_STR = [*TOOL[:2], _call('{"city": "Paris"}', content=""), *TOOL[3:]]
THINK = "<think>\nadd\n</think>\n\n4"
REASON = [
    _user("2+2?"),
    _assistant(THINK),
    _user("3+3?"),
    _assistant("<think>\nagain\n</think>\n\n6"),
]
HARMONY = [SYSTEM, _user("2+2?"), _assistant("4", thinking="add"), _user("3+3?")]
HARMONY += [_assistant("6", thinking="again")]

IM = "<|im_end|>\n"
DS = "<｜end▁of▁sentence｜>"
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN35_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>"
)
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
MISTRAL_CALL = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>'
)
DS_CALL = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' + DS
)
HARMONY_CALL = (
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
)


def _final(text, end="<|return|>"):
    return f"<|channel|>final<|message|>{text}{end}"


WHOLE = None  # the document holds the whole record
# family -> case -> [(messages the document holds: WHOLE or a turn count, [targets])]
TABLE = {
    "chatml": {
        "single": [(WHOLE, ["4" + IM])],
        "multi": [(WHOLE, ["Hello." + IM, "Once more." + IM])],
    },
    "qwen2_5": {
        "single": [(WHOLE, ["4" + IM])],
        "multi": [(WHOLE, ["Hello." + IM, "Once more." + IM])],
        "tool": [(WHOLE, [QWEN_CALL + IM, "18 C in Paris." + IM])],
    },
    "qwen3": {  # the empty <think></think> of a non-reasoning turn is context
        "single": [(WHOLE, ["4" + IM])],
        "multi": [(WHOLE, ["Hello." + IM, "Once more." + IM])],
        "tool": [(WHOLE, [QWEN_CALL + IM, "18 C in Paris." + IM])],
        # history drops reasoning: the first turn trained apart, as the last turn
        "reason": [(WHOLE, [f"<think>\nagain\n</think>\n\n6{IM}"]), (2, [THINK + IM])],
    },
    "qwen3_5": {  # the generation prompt pre-fills "<think>\n"
        "single": [(WHOLE, ["4" + IM])],
        "multi": [(WHOLE, ["Hello." + IM, "Once more." + IM])],
        "tool": [(WHOLE, [QWEN35_CALL + IM, "18 C in Paris." + IM])],
        "reason": [(WHOLE, [f"again\n</think>\n\n6{IM}"]), (2, [f"add\n</think>\n\n4{IM}"])],
    },
    "deepseek_r1_distill": {  # the training patch: the last turn shows its reasoning
        "single": [(WHOLE, ["4" + DS])],
        "multi": [(WHOLE, ["Hello." + DS, "Once more." + DS])],
        "reason": [(WHOLE, [f"again\n</think>\n\n6{DS}"]), (2, [f"add\n</think>\n\n4{DS}"])],
    },
    "deepseek_v3": {
        "single": [(WHOLE, ["4" + DS])],
        "multi": [(WHOLE, ["Hello." + DS, "Once more." + DS])],
        "tool_str": [(WHOLE, [DS_CALL, "18 C in Paris." + DS])],
        "reason": [(WHOLE, [f"again\n</think>\n\n6{DS}"]), (2, [f"add\n</think>\n\n4{DS}"])],
    },
    "llama3_1": {
        "single": [(WHOLE, ["4<|eot_id|>"])],
        "multi": [(WHOLE, ["Hello.<|eot_id|>", "Once more.<|eot_id|>"])],
        "tool": [(WHOLE, [LLAMA_CALL, "18 C in Paris.<|eot_id|>"])],
    },
    "llama3_2": {  # today's date in the system header: the same in every rendering
        "single": [(WHOLE, ["4<|eot_id|>"])],
        "multi": [(WHOLE, ["Hello.<|eot_id|>", "Once more.<|eot_id|>"])],
        "tool": [(WHOLE, [LLAMA_CALL, "18 C in Paris.<|eot_id|>"])],
    },
    "gemma2": {  # no system role in Gemma 2's template
        "single_plain": [(WHOLE, ["4<end_of_turn>\n"])],
        "multi_plain": [(WHOLE, ["Hello.<end_of_turn>\n", "Once more.<end_of_turn>\n"])],
    },
    "gemma3": {
        "single": [(WHOLE, ["4<end_of_turn>\n"])],
        "multi": [(WHOLE, ["Hello.<end_of_turn>\n", "Once more.<end_of_turn>\n"])],
    },
    "mistral_v0_3": {  # the training patch: the system prompt in the answered user turn
        "single": [(WHOLE, [" 4</s>"])],
        "multi": [(WHOLE, [" Once more.</s>"]), (3, [" Hello.</s>"])],
        "tool": [(WHOLE, [MISTRAL_CALL, " 18 C in Paris.</s>"])],
    },
    "phi3": {  # EOS only at the conversation's end: history turns apart
        "single": [(WHOLE, ["4<|end|>\n<|endoftext|>"])],
        "multi": [
            (WHOLE, ["Once more.<|end|>\n<|endoftext|>"]),
            (3, ["Hello.<|end|>\n<|endoftext|>"]),
        ],
    },
    "phi3_5": {
        "single": [(WHOLE, ["4<|end|>\n<|endoftext|>"])],
        "multi": [
            (WHOLE, ["Once more.<|end|>\n<|endoftext|>"]),
            (3, ["Hello.<|end|>\n<|endoftext|>"]),
        ],
    },
    "phi4": {
        "single": [(WHOLE, ["4<|im_end|>"])],
        "multi": [(WHOLE, ["Hello.<|im_end|>", "Once more.<|im_end|>"])],
    },
    "gpt_oss": {  # history ends <|end|> and drops analysis: each turn as the last
        "single": [(WHOLE, [_final("4")])],
        "multi": [(WHOLE, [_final("Once more.")]), (3, [_final("Hello.")])],
        "tool": [(WHOLE, [HARMONY_CALL, _final("18 C in Paris.")])],
        "harmony": [
            (WHOLE, ["<|channel|>analysis<|message|>again<|end|><|start|>assistant" + _final("6")]),
            (3, ["<|channel|>analysis<|message|>add<|end|><|start|>assistant" + _final("4")]),
        ],
    },
}
CASES = {
    "single": (SINGLE, None),
    "multi": (MULTI, None),
    "single_plain": (SINGLE[1:], None),
    "multi_plain": (MULTI[1:], None),
    "tool": (TOOL, TOOLS),
    "tool_str": (TOOL_STR, TOOLS),
    "reason": (REASON, None),
    "harmony": (HARMONY, None),
}
ROWS = [(family, case) for family in TABLE for case in TABLE[family]]


def _runs(tok, ids, labels) -> list[str]:
    """The decoded contiguous runs of targets."""
    runs, current = [], []
    for token, label in zip(ids.tolist(), labels.tolist(), strict=True):
        if label == -100:
            runs, current = runs + ([current] if current else []), []
        else:
            current.append(token)
    return [tok.decode(run) for run in runs + ([current] if current else [])]


def _documents(family, messages, tools, **kwargs):
    tok = family_tokenizer(family)
    options = SFTOptions.build(format="chat", seq_len=4096, **kwargs)
    record = {"messages": messages, "tools": tools}  # tools from the record's tools_field
    return tok, render_record(record, tok, options, "record 7")


@pytest.mark.parametrize(("family", "case"), ROWS, ids=[f"{f}-{c}" for f, c in ROWS])
def test_each_family_trains_what_the_table_says(family, case):
    messages, tools = CASES[case]
    tok, documents = _documents(family, messages, tools)
    template, _ = training_template(template_text(family))
    expected = TABLE[family][case]
    assert len(documents) == len(expected)
    for (ids, labels), (upto, targets) in zip(documents, expected, strict=True):
        held = messages if upto is WHOLE else messages[:upto]
        reference = tok.apply_chat_template(held, tools=tools, chat_template=template)
        assert ids.tolist() == reference["input_ids"]
        assert _runs(tok, ids, labels) == targets
        assert ((labels == ids) | (labels == -100)).all()


def test_the_table_covers_every_family():
    assert set(TABLE) == set(FAMILIES)


def test_enable_thinking_false_pre_fills_the_empty_block_and_refuses_reasoning():
    """Qwen3's ``enable_thinking=False`` writes the empty block in the prompt:
    the same target; a turn with reasoning cannot follow that prompt."""
    tok, [(ids, labels)] = _documents(
        "qwen3", SINGLE, None, chat_template_kwargs={"enable_thinking": False}
    )
    assert _runs(tok, ids, labels) == ["4" + IM]
    with pytest.raises(SFTDataError, match="record 7: assistant turn 1 does not follow"):
        _documents("qwen3", REASON, None, chat_template_kwargs={"enable_thinking": False})


def test_a_role_the_template_refuses_names_the_record_and_the_reason():
    with pytest.raises(SFTDataError, match="record 7: the chat template refuses .*System role"):
        _documents("gemma2", SINGLE, None)


def test_a_template_that_drops_tool_calls_is_refused():
    """DeepSeek-R1 distills write content, not tool_calls, when content is set."""
    with pytest.raises(SFTDataError, match="record 7: assistant turn 2 calls 'get_weather'"):
        _documents("deepseek_r1_distill", TOOL_STR, TOOLS)


def test_tools_reach_the_template():
    """Qwen2.5 writes the tool schemas into its system turn."""
    tok, [(ids, _)] = _documents("qwen2_5", TOOL, TOOLS)
    assert '"name": "get_weather", "description": "Weather of a city"' in tok.decode(ids)
    tok, [(ids, _)] = _documents("qwen2_5", TOOL, None)
    assert "Weather of a city" not in tok.decode(ids)


def test_chat_template_overrides_the_tokenizer_as_text_or_file(tmp_path):
    """``chat_template`` replaces the tokenizer's (here ChatML's) template."""
    phi4 = template_text("phi4")
    tok = family_tokenizer("chatml")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_sep|>"]})
    path = tmp_path / "phi4.jinja"
    path.write_text(phi4)
    for value in (phi4, str(path)):
        options = SFTOptions.build(format="chat", seq_len=512, chat_template=value)
        [(ids, labels)] = render_record({"messages": SINGLE}, tok, options, "record 7")
        assert tok.decode(ids).endswith("<|im_start|>assistant<|im_sep|>4<|im_end|>")
        assert _runs(tok, ids, labels) == ["4<|im_end|>"]
    with pytest.raises(ValueError, match="chat_template='no/such.jinja' is neither"):
        SFTOptions.build(format="chat", seq_len=512, chat_template="no/such.jinja")


def test_chat_template_kwargs_must_be_a_mapping():
    with pytest.raises(ValueError, match=r"chat_template_kwargs=\['enable_thinking'\] must map"):
        SFTOptions.build(format="chat", seq_len=512, chat_template_kwargs=["enable_thinking"])
