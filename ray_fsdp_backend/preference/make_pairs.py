"""Write example preference pairs a tiny model learns to prefer in a minute.

    python -m ray_fsdp_backend.preference.make_pairs /tmp/rfb-pairs/train.jsonl
    python -m ray_fsdp_backend.preference.make_pairs /tmp/rfb-pairs/train.parquet --count 400
    python -m ray_fsdp_backend.preference.make_pairs pairs.jsonl --format text

Each pair asks a short question and prefers the right answer: a sum of two
numbers below ten in words (``what is three plus four.``: chosen ``seven.``,
rejected a sum off by 1 to 3) or an echo (``say river.``: chosen ``river.``,
rejected another word of a short list). Lowercase letters, spaces and
periods only: the tiny tokenizer of ``python -m
ray_fsdp_backend.models.tiny_pretrained DIR --chat`` (96 tokens, trained on
the shipped corpus) knows no digits, ``?`` or ``+``, and would read both
answers as ``<unk>``. ``--format chat`` (the default) writes ``{prompt:
[user message], chosen: [assistant message], rejected: [assistant
message]}``, rendered by the model's chat template; ``--format text`` writes
``{prompt, chosen, rejected}`` strings (``"three plus four is"``, ``"
seven."``). A ``.parquet`` name writes
parquet, anything else JSON lines. The same ``--seed`` writes the same file.
For ``examples/dpo.yaml`` (``data.format: preference``; docs/preference.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random

WORDS = (
    "river stone cloud green quiet north bright apple candle forest maple "
    "ocean pepper silver tiger violet winter yellow zebra garden"
).split()
NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen twenty twentyone"
).split()


def sum_pair(rng: random.Random, chat: bool) -> dict:
    a, b = rng.randrange(10), rng.randrange(10)
    wrong = a + b + rng.choice((-3, -2, -1, 1, 2, 3))
    wrong = wrong if wrong >= 0 else a + b + 1
    question = f"{NUMBERS[a]} plus {NUMBERS[b]}"
    prompt = f"what is {question}." if chat else f"{question} is"
    right, wrong = f"{NUMBERS[a + b]}.", f"{NUMBERS[wrong]}."
    return _pair(prompt, right if chat else f" {right}", wrong if chat else f" {wrong}", chat)


def echo_pair(rng: random.Random, chat: bool) -> dict:
    word, other = rng.sample(WORDS, 2)
    prompt = f"say {word}." if chat else f"say {word}:"
    right, wrong = f"{word}.", f"{other}."
    return _pair(prompt, right if chat else f" {right}", wrong if chat else f" {wrong}", chat)


def _pair(prompt: str, chosen: str, rejected: str, chat: bool) -> dict:
    if not chat:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def make_pairs(count: int = 300, *, format: str = "chat", seed: int = 0) -> list[dict]:
    """``count`` pairs, sums and echoes alternating (module docstring)."""
    if format not in ("chat", "text"):
        raise ValueError(f"format={format!r} is not one of chat, text")
    rng = random.Random(seed)
    makers = (sum_pair, echo_pair)
    return [makers[i % 2](rng, format == "chat") for i in range(count)]


def write_pairs(path: str, records: list[dict]) -> str:
    """``records`` as parquet (a ``.parquet`` name) or JSON lines at ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the file to write (.jsonl or .parquet)")
    parser.add_argument("--count", type=int, default=300, help="pairs (default 300)")
    parser.add_argument("--format", default="chat", choices=["chat", "text"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_pairs(args.path, make_pairs(args.count, format=args.format, seed=args.seed))
    print(f"wrote {args.count} {args.format} preference pairs to {args.path}")


if __name__ == "__main__":
    main()
