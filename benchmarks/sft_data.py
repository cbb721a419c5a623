"""The SFT data pipeline's throughput and packing efficiency (docs/benchmarks.md).

A chat dataset of mixed lengths (conversations of 1-4 exchanges, answers of
1-120 words, lognormal) is written as JSON lines; a byte-level BPE tokenizer
with a ChatML template is trained on the shipped corpus (vocabulary 2,000).
Measured:

- ``in_process``: one core rendering, masking and packing every record
  (:func:`ray_fsdp_backend.sft.packing.pack_documents` after
  :func:`ray_fsdp_backend.sft.render.render_record`), batch by batch as the
  Ray Data stage does;
- ``ray_data``: ``rfb.sft_dataset(...)`` on a local Ray cluster of
  ``--cpus`` CPUs, every row iterated (``iter_batches``), from the call to
  the last row (the driver's check of every record included: it renders
  the whole dataset once per set of options, then is cached by content);
- packing: the padded fraction of row tokens with packing (first-fit
  decreasing over batches of 1,024 records) and without (one record a row).

    python -m benchmarks.sft_data                     # 20,000 records, seq_len 2048
    python -m benchmarks.sft_data --records 2000 --seq-len 1024 --cpus 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

WORDS = (
    "the model learns from answers and the prompt is masked while packing keeps rows full "
    "of documents that never attend to each other because positions restart"
).split()
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ray_fsdp_backend.models.tiny_pretrained import CORPUS

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<eos>", "<pad>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train(
        [CORPUS],
        trainers.BpeTrainer(vocab_size=2000, special_tokens=special, initial_alphabet=alphabet),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.chat_template = CHATML
    return fast


def conversation(rng: random.Random) -> list[dict]:
    def words(mean):
        n = max(1, min(120, int(rng.lognormvariate(mean, 0.8))))
        return " ".join(rng.choice(WORDS) for _ in range(n))

    messages = [{"role": "system", "content": words(1.5)}] if rng.random() < 0.3 else []
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        messages += [
            {"role": "user", "content": words(2.5)},
            {"role": "assistant", "content": words(3.2)},
        ]
    return messages


def write_dataset(directory: str, records: int, files: int = 8, seed: int = 0) -> None:
    rng = random.Random(seed)
    for f in range(files):
        with open(os.path.join(directory, f"part-{f:03d}.jsonl"), "w") as out:
            for _ in range(f, records, files):
                out.write(json.dumps({"messages": conversation(rng)}) + "\n")


def in_process(directory: str, tokenizer, seq_len: int) -> dict:
    from ray_fsdp_backend.sft.packing import PackCounts, pack_documents
    from ray_fsdp_backend.sft.records import SFTOptions
    from ray_fsdp_backend.sft.render import render_record

    options = SFTOptions.build(format="chat", seq_len=seq_len)
    records = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name)) as f:
            records += [json.loads(line) for line in f]
    start, counts = time.perf_counter(), PackCounts()
    for a in range(0, len(records), 1024):
        batch = records[a : a + 1024]
        docs = [d for r in batch for d in render_record(r, tokenizer, options, "bench")]
        pack_documents(docs, seq_len, tokenizer.pad_token_id, counts=counts, records=len(batch))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens_per_s": counts.tokens / seconds, **counts.as_dict()}


def ray_data(directory: str, tokenizer, seq_len: int, cpus: int) -> dict:
    import ray

    import ray_fsdp_backend as rfb
    from ray_fsdp_backend.runtime.ray_start import init_ray

    init_ray("local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        out = {}
        for packing in (True, False):
            start, rows, real = time.perf_counter(), 0, 0
            ds = rfb.sft_dataset(directory, tokenizer, seq_len=seq_len, packing=packing)
            for batch in ds.iter_batches(batch_size=64, batch_format="numpy"):
                rows += len(batch["input_ids"])
                real += int((batch["input_ids"] != tokenizer.pad_token_id).sum())
            seconds = time.perf_counter() - start
            key = "packed" if packing else "unpacked"
            out[key] = {
                "seconds": seconds,
                "rows": rows,
                "tokens_per_s": real / seconds,
                "padding_fraction": 1 - real / (rows * seq_len),
            }
        return out
    finally:
        ray.shutdown()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as directory:
        write_dataset(directory, args.records)
        result = {
            "records": args.records,
            "seq_len": args.seq_len,
            "in_process": in_process(directory, tokenizer, args.seq_len),
            "ray_data": ray_data(directory, tokenizer, args.seq_len, args.cpus),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
