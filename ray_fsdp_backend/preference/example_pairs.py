"""Toy preference pairs for ``examples/reward.yaml``: a polite answer chosen, a
curt one rejected, about one of a few topics::

    python -m ray_fsdp_backend.preference.example_pairs /tmp/rfb-tiny-chat/pairs.jsonl

Records ``{"prompt", "chosen", "rejected"}`` (``data.format: preference``),
seeded: the same file on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import random

TOPICS = (
    "the river", "a garden", "the old map", "winter roads", "a small boat",
    "the market", "tea", "a lamp", "the hills", "bread",
)  # fmt: skip
CHOSEN = (
    "Gladly: {t} is worth a look, and here is why.",
    "Sure, happy to help with {t}.",
    "Good question about {t}; let me explain it.",
)
REJECTED = ("No.", "Ask someone else about {t}.", "Whatever, {t} is boring.")


def example_pairs(count: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """``count`` seeded pairs."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        topic = rng.choice(TOPICS)
        records.append({
            "prompt": f"Tell me about {topic}.",
            "chosen": rng.choice(CHOSEN).format(t=topic),
            "rejected": rng.choice(REJECTED).format(t=topic),
        })  # fmt: skip
    return records


def save_example_pairs(path: str | os.PathLike, count: int = 64, seed: int = 0) -> str:
    """Write :func:`example_pairs` as JSONL to ``path``; returns it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for record in example_pairs(count, seed):
            f.write(json.dumps(record) + "\n")
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=64)
    args = parser.parse_args()
    print(f"wrote {args.count} pairs to {save_example_pairs(args.path, args.count)}")


if __name__ == "__main__":
    main()
