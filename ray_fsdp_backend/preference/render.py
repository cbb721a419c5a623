"""A :class:`~ray_fsdp_backend.preference.pairs.Pair` to its two token
documents, ``prompt + chosen`` and ``prompt + rejected``: ``(input_ids,
labels)`` with the labels unshifted, -100 on the prompt.

Text pairs are ``prompt + response`` tokenized with the tokenizer's special
tokens and the EOS appended, the loss on the response and the EOS (SFT's
``prompt_completion`` without a chat template; TRL's ``DPOTrainer`` adds the
EOS to text responses the same way). Conversational pairs render ``prompt +
response`` messages with the chat template exactly as SFT renders a
conversation (:func:`~ray_fsdp_backend.sft.render.chat_documents`: the
record's tools, ``chat_template``, ``chat_template_kwargs``, the families'
training patches), the prompt's own assistant turns untrained: the targets
are the response's assistant turns as the model writes each after its
generation prompt, end-of-turn text included (TRL: the tokens after the
prompt rendered with ``add_generation_prompt=True``). A response the template
renders apart from the whole conversation (a multi-turn response whose
earlier turns it rewrites once later turns follow) is refused: a response is
one sequence.
"""

from __future__ import annotations

from ray_fsdp_backend.preference.pairs import Pair, PreferenceOptions
from ray_fsdp_backend.sft.options import SFTDataError
from ray_fsdp_backend.sft.render import Document, chat_documents, plain_document


def pair_documents(
    pair: Pair, tokenizer, options: PreferenceOptions, where: str
) -> tuple[Document, Document]:
    """``(chosen, rejected)`` documents of ``pair`` (module docstring).

    Raises:
        SFTDataError: the template refuses a conversation, or renders a
            response as more than one sequence.
    """
    if not pair.conversational:
        return tuple(
            plain_document(
                pair.prompt + text, [(len(pair.prompt), len(pair.prompt + text))], tokenizer
            )
            for text in (pair.chosen, pair.rejected)
        )
    prompt = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in pair.prompt]
    documents = []
    for name, response in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        docs = chat_documents(prompt + response, tokenizer, options.chat, where, pair.tools)
        if len(docs) != 1:
            raise SFTDataError(
                f"{where}: the chat template renders the {name} response's assistant turns "
                f"differently once later turns follow ({len(docs)} sequences), so the response "
                "is not one sequence; give a one-turn response or a prefix-preserving "
                "chat_template"
            )
        documents.append(docs[0])
    return documents[0], documents[1]
