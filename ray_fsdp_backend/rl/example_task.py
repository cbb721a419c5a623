"""The task of ``examples/grpo.yaml``: a tiny model learns to write one letter often.

The prompts are chat questions from the tiny model's corpus, each record
naming a ``letter``; :func:`letter_share` rewards the share of a response's
letters that are that letter (TRL's reward signature: the record's fields
come as keyword arguments). A random tiny model starts near the letter's
frequency in its sampled tokens; GRPO raises it within a few dozen steps.
Write the prompts::

    python -m ray_fsdp_backend.rl.example_task /tmp/rfb-prompts/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import os

from ray_fsdp_backend.models.tiny_pretrained import CHAT_EVAL, CHAT_TRAIN

LETTER = "e"


def letter_share(prompts: list, completions: list[str], letter: list[str], **_) -> list[float]:
    """Per completion: its letters that are ``letter`` over all its letters
    (0 for a completion with none)."""
    rewards = []
    for text, wanted in zip(completions, letter, strict=True):
        letters = [c for c in text.lower() if c.isalpha()]
        rewards.append(sum(c == wanted for c in letters) / len(letters) if letters else 0.0)
    return rewards


def prompt_records(copies: int = 8) -> list[dict]:
    """Chat prompts (the tiny corpus's questions), each with ``letter``."""
    questions = [q for q, _ in CHAT_TRAIN + CHAT_EVAL]
    return [
        {"prompt": [{"role": "user", "content": q}], "letter": LETTER}
        for _ in range(copies)
        for q in questions
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="JSONL file to write")
    parser.add_argument("--copies", type=int, default=8, help="copies of the question set")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.path)), exist_ok=True)
    records = prompt_records(args.copies)
    with open(args.path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"wrote {len(records)} prompts to {args.path}")


if __name__ == "__main__":
    main()
