"""Preference pairs rendered (issue 56, item 1): with the real chat templates
of three families, each document's tokens equal ``apply_chat_template`` of
prompt + response and its targets are the response only (the text after the
prompt's generation prompt: TRL's definition, computed here independently);
text pairs are prompt + response + EOS with the loss on the response and EOS;
an implicit prompt is split at the last shared message (TRL's
``extract_prompt``, its docstring's examples)."""

from __future__ import annotations

import numpy as np
import pytest

from ray_fsdp_backend.preference.pairs import PreferenceOptions, extract_prompt, read_pair
from ray_fsdp_backend.preference.render import pair_documents
from ray_fsdp_backend.sft.options import SFTDataError
from tests import sft_tokenizers as st
from tests.sft_families import family_tokenizer

pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "Be brief."}
PROMPT = [SYSTEM, {"role": "user", "content": "What is 2+2?"}]
HISTORY = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]
CHOSEN = [{"role": "assistant", "content": "4"}]
REJECTED = [{"role": "assistant", "content": "22, I think"}]
OPTIONS = PreferenceOptions.build(seq_len=512)


def _targets(labels: np.ndarray) -> np.ndarray:
    return labels[labels != -100]


def _reference(tok, prompt, response):
    """TRL's split: the ids of prompt + response, and the text after the
    prompt rendered with its generation prompt."""
    ids = list(
        tok.apply_chat_template(prompt + response, tokenize=True, return_dict=True)["input_ids"]
    )
    whole = tok.apply_chat_template(prompt + response, tokenize=False)
    head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert whole.startswith(head)
    return ids, whole[len(head) :]


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_1", "gemma3"])
@pytest.mark.parametrize("prompt", [PROMPT, HISTORY], ids=["system", "multi-turn"])
def test_chat_pairs_equal_the_template_with_the_loss_on_the_response(family, prompt):
    tok = family_tokenizer(family)
    if family == "gemma3":  # Gemma folds the system prompt into the user turn
        prompt = [m for m in prompt if m["role"] != "system"]
    record = {"prompt": prompt, "chosen": CHOSEN, "rejected": REJECTED}
    documents = pair_documents(read_pair(record, OPTIONS, "f:1"), tok, OPTIONS, "f:1")
    for (ids, labels), response in zip(documents, (CHOSEN, REJECTED), strict=True):
        ref_ids, target = _reference(tok, prompt, response)
        assert ids.tolist() == ref_ids
        assert tok.decode(_targets(labels)) == target
        assert response[0]["content"] in target
        first = int(np.flatnonzero(labels != -100)[0])
        assert (labels[first:] == ids[first:]).all()  # one run: the response to the end


def test_whole_conversations_with_an_explicit_prompt_are_cut_after_it():
    tok = family_tokenizer("qwen2_5")
    whole = {"prompt": PROMPT, "chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}
    turns = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}
    a = pair_documents(read_pair(whole, OPTIONS, "f:1"), tok, OPTIONS, "f:1")
    b = pair_documents(read_pair(turns, OPTIONS, "f:1"), tok, OPTIONS, "f:1")
    for (ids_a, lab_a), (ids_b, lab_b) in zip(a, b, strict=True):
        assert ids_a.tolist() == ids_b.tolist() and lab_a.tolist() == lab_b.tolist()


def test_text_pairs_are_prompt_response_and_eos():
    tok = st.tokenizer(None)
    record = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    chosen, rejected = pair_documents(read_pair(record, OPTIONS, "f:1"), tok, OPTIONS, "f:1")
    for (ids, labels), answer in ((chosen, "4"), (rejected, "5")):
        ref = tok("2+2=" + answer)["input_ids"] + [tok.eos_token_id]
        assert ids.tolist() == ref
        assert tok.decode(_targets(labels)) == answer + tok.eos_token
        assert not set(_targets(labels).tolist()) & set(tok("2+2=")["input_ids"][:-1])


def test_implicit_prompt_is_trls_extract_prompt():
    # trl 1.16 data_utils.extract_prompt's docstring example
    chosen = [{"role": "user", "content": "What color is the sky?"}]
    chosen += [{"role": "assistant", "content": "It is blue."}]
    rejected = chosen[:1] + [{"role": "assistant", "content": "It is green."}]
    pair = read_pair({"chosen": chosen, "rejected": rejected}, OPTIONS, "f:1")
    assert pair.prompt == chosen[:1] and pair.chosen == chosen[1:] and pair.rejected == rejected[1:]
    # multi-turn: split at the last shared message
    long_c = HISTORY + CHOSEN
    long_r = HISTORY + REJECTED
    pair = read_pair({"chosen": long_c, "rejected": long_r}, OPTIONS, "f:1")
    assert pair.prompt == HISTORY and pair.chosen == CHOSEN
    # text: the shared characters, the space kept with the response
    assert extract_prompt("The sky is blue.", "The sky is green.") == (
        "The sky is",
        " blue.",
        " green.",
    )
    # UltraFeedback's layout: a text prompt beside whole conversations
    pair = read_pair({"prompt": "sky?", "chosen": chosen, "rejected": rejected}, OPTIONS, "f:1")
    assert pair.prompt == chosen[:1] and pair.chosen == chosen[1:]


def test_implicit_prompt_documents_equal_the_explicit_ones():
    tok = family_tokenizer("llama3_1")
    implicit = {"chosen": HISTORY + CHOSEN, "rejected": HISTORY + REJECTED}
    explicit = {"prompt": HISTORY, "chosen": CHOSEN, "rejected": REJECTED}
    a = pair_documents(read_pair(implicit, OPTIONS, "f:1"), tok, OPTIONS, "f:1")
    b = pair_documents(read_pair(explicit, OPTIONS, "f:1"), tok, OPTIONS, "f:1")
    assert [d[1].tolist() for d in a] == [d[1].tolist() for d in b]


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"prompt": "a", "chosen": "b"}, "field 'rejected' is missing"),
        ({"prompt": "a", "chosen": "b", "rejected": "b"}, "are the same response"),
        ({"prompt": PROMPT, "chosen": CHOSEN, "rejected": list(CHOSEN)}, "same response"),
        ({"chosen": HISTORY[:1] + CHOSEN, "rejected": HISTORY[2:] + REJECTED}, "share no first"),
        (
            {"prompt": PROMPT, "chosen": HISTORY + CHOSEN, "rejected": PROMPT + REJECTED},
            "prompts differ",
        ),
        ({"prompt": "a", "chosen": "b", "rejected": REJECTED}, "all text or all messages"),
        ({"prompt": "a", "chosen": "b", "rejected": 4}, "not text or a list of messages"),
        (
            {"prompt": PROMPT, "chosen": [{"role": "bot", "content": "4"}], "rejected": REJECTED},
            "field 'chosen': message 0 has role 'bot'",
        ),
    ],
)
def test_bad_pairs_are_refused_naming_the_rule(record, reason):
    with pytest.raises(SFTDataError, match="f:7: ") as info:
        read_pair(record, PreferenceOptions.build(seq_len=64), "f:7")
    assert reason in str(info.value)


def test_field_names_are_configurable():
    options = PreferenceOptions.build(
        seq_len=64, prompt_field="q", chosen_field="good", rejected_field="bad"
    )
    pair = read_pair({"q": "x", "good": "1", "bad": "2"}, options, "f:1")
    assert (pair.prompt, pair.chosen, pair.rejected) == ("x", "1", "2")
    with pytest.raises(ValueError, match="must differ"):
        PreferenceOptions.build(seq_len=64, chosen_field="prompt")
