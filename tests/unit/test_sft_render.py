"""A record's tokens and loss labels against the tokenizer alone (docs/sft.md).

For three chat templates (ChatML, a Llama-3-style header template, one with a
default system prompt and text between turns): the tokens equal
``apply_chat_template(..., tokenize=True)``, and the labels are -100 exactly
outside the assistant turns, whose targets are the tokens of each answer and
what the template writes after it (``TURN_END``).
"""

from __future__ import annotations

import numpy as np
import pytest

from ray_fsdp_backend.sft.records import SFTDataError, SFTOptions
from ray_fsdp_backend.sft.render import render_record
from tests import sft_tokenizers as st


def _runs(labels: np.ndarray) -> list[list[int]]:
    """The contiguous runs of targets (not -100), in order."""
    runs, current = [], []
    for value in labels.tolist():
        if value == -100:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(value)
    return runs + ([current] if current else [])


def _render(record, tok, **kwargs):
    """The record's one document."""
    options = SFTOptions.build(seq_len=kwargs.pop("seq_len", 512), **kwargs)
    (document,) = render_record(record, tok, options, "test record")
    return document


@pytest.mark.parametrize("template", sorted(st.TEMPLATES))
def test_chat_tokens_and_masks_equal_the_template(template):
    tok = st.tokenizer(template)
    for messages in st.conversations():
        ids, labels = _render({"messages": messages}, tok, format="chat")
        assert ids.tolist() == st.reference_ids(tok, messages)
        expected = [
            tok(m["content"] + st.TURN_END[template], add_special_tokens=False)["input_ids"]
            for m in messages
            if m["role"] == "assistant"
        ]
        assert _runs(labels) == expected
        assert ((labels == ids) | (labels == -100)).all()


def test_default_system_prompt_is_not_trained():
    tok = st.tokenizer("default_system")
    messages = st.conversations()[1]  # no system message: the template adds one
    ids, labels = _render({"messages": messages}, tok, format="chat")
    text = tok.decode(ids)
    assert text.startswith("<<SYS>>You are a helpful assistant.")
    assert tok.decode([t for t in labels.tolist() if t != -100]) == "4</s>\n== next ==\n"


def test_train_on_prompt_trains_every_token():
    tok = st.tokenizer("llama3")
    messages = st.conversations()[0]
    ids, labels = _render({"messages": messages}, tok, format="chat", train_on_prompt=True)
    assert ids.tolist() == st.reference_ids(tok, messages)
    assert (labels == ids).all()


def test_prompt_completion_with_a_template_is_a_two_turn_chat():
    tok = st.tokenizer("chatml")
    record = {"prompt": "What is 2+2?", "completion": "4"}
    ids, labels = _render(record, tok, format="prompt_completion")
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    assert ids.tolist() == st.reference_ids(tok, chat)
    assert _runs(labels) == [tok("4<|im_end|>\n", add_special_tokens=False)["input_ids"]]


def test_prompt_completion_without_a_template_is_concatenated_with_eos():
    tok = st.tokenizer(None)
    record = {"q": "Question: 2+2=", "a": " 4, of course"}
    ids, labels = _render(
        record, tok, format="prompt_completion", prompt_field="q", completion_field="a"
    )
    assert ids.tolist() == tok("Question: 2+2= 4, of course")["input_ids"] + [tok.eos_token_id]
    targets = [t for t in labels.tolist() if t != -100]
    assert tok.decode(targets) == " 4, of course<eos>"
    assert labels[: len(tok("Question: 2+2=")["input_ids"])].tolist() == [-100] * len(
        tok("Question: 2+2=")["input_ids"]
    )


def test_text_trains_every_token_and_ends_with_eos():
    tok = st.tokenizer("chatml")  # a template does not matter for text
    ids, labels = _render({"text": "plain words here"}, tok, format="text")
    assert ids.tolist() == tok("plain words here")["input_ids"] + [tok.eos_token_id]
    assert (labels == ids).all()


def test_a_turn_that_does_not_follow_its_generation_prompt_is_refused():
    """The generation prompt (``... assistant: ``) is not where the turn starts
    (`` | assistant: 4``): the error names the record and the turn, and its
    advice is a template or its arguments, not ``train_on_prompt``."""
    tok = st.tokenizer("chatml")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if not loop.last %} | {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(SFTDataError, match="test record: assistant turn 1 does not follow") as err:
        _render({"messages": st.conversations()[1]}, tok, format="chat")
    assert "chat_template" in str(err.value) and "train_on_prompt" not in str(err.value)
    ids, labels = _render(
        {"messages": st.conversations()[1]}, tok, format="chat", train_on_prompt=True
    )
    assert (labels == ids).all()
