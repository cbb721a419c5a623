"""``data.format`` chat / prompt_completion in the training YAML, without Ray:
the keys and their refusals, the held-out split, the eval rows each dp rank
reads and the eval loss against a one-process reference."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ray_fsdp_backend.trainer.schema.spec import TrainOptions, check_spec

pytest.importorskip("transformers")


def _errors(data=None, model=None, train=None) -> list[str]:
    doc = {"distributed": {}, "data": data or {}, "train": train or {}}
    if model is not None:
        doc["model"] = model
    return check_spec(doc)


@pytest.mark.parametrize(
    ("data", "train", "words"),
    [
        ({"format": "xml"}, {}, "format='xml' is not one of text, chat, prompt_completion"),
        ({"train_on_prompt": "yes"}, {}, "train_on_prompt='yes' must be true or false"),
        ({"packing": 1}, {}, "packing=1 must be true or false"),
        ({"messages_field": ""}, {}, "messages_field='' must be a record field's name or null"),
        ({"prompt_field": 3}, {}, "prompt_field=3 must be a record field's name"),
        ({"eval_fraction": 1.5}, {}, "eval_fraction=1.5 must be a number between 0 and 1"),
        ({"eval_fraction": 0}, {}, "eval_fraction=0 must be a number between 0 and 1"),
        ({"eval_path": 7}, {}, "eval_path=7 must be a string or null"),
        ({}, {"eval_every": -1}, "eval_every=-1 must be a non-negative number"),
        ({}, {"eval_every": 2.5}, "eval_every=2.5 must be a non-negative int"),
        ({"formt": "chat"}, {}, "formt"),
        ({"roles": {"human": 1}}, {}, "roles={'human': 1} must map the dataset's role names"),
        ({"tools_field": ""}, {}, "tools_field='' must be a record field's name"),
        ({"messages_field": 3}, {}, "messages_field=3 must be a record field's name or null"),
        ({"chat_template": "no/such.jinja"}, {}, "chat_template='no/such.jinja' is neither"),
        ({"chat_template": 3}, {}, "chat_template=3 must be a Jinja template or a file path"),
        ({"chat_template_kwargs": ["x"]}, {}, "chat_template_kwargs=['x'] must map names"),
    ],
)
def test_bad_values_name_the_key_and_value(data, train, words):
    errors = _errors(data, train=train)
    assert any(words in e for e in errors), errors


@pytest.mark.parametrize(
    ("data", "train", "words"),
    [
        # The byte-level model has no tokenizer, so no chat template.
        ({"format": "chat", "path": "/d.jsonl"}, {}, "data.format='chat' needs model.pretrained"),
        ({"format": "text", "eval_path": "/e.jsonl"}, {}, "data.eval_path with data.format='text'"),
        ({"eval_fraction": 0.1}, {}, "data.eval_fraction with data.format='text'"),
        ({}, {"eval_every": 5}, "train.eval_every=5 needs a held-out set"),
        ({"packing": True, "source": "ray_data", "path": "/d"}, {}, "data.packing with data."),
    ],
)
def test_cross_section_refusals(data, train, words):
    errors = _errors(data, train=train)
    assert any(words in e for e in errors), errors


def test_sft_keys_need_a_path_and_one_held_out_set(tmp_path):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    model = {"pretrained": save_tiny_pretrained("llama", tmp_path / "m", chat=True)}
    data = {"format": "prompt_completion", "eval_path": "/e", "eval_fraction": 0.1}
    errors = _errors(data, model)
    assert any("data.format='prompt_completion' needs data.path" in e for e in errors), errors
    assert any("choose one held-out set" in e for e in errors), errors


def test_pretrained_text_refusals_stay_and_point_at_the_record_formats(tmp_path):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    model = {"pretrained": save_tiny_pretrained("llama", tmp_path / "m")}
    errors = _errors({"source": "ray_data", "path": "/d"}, model)
    assert any("use data.format chat or prompt_completion" in e for e in errors), errors
    errors = _errors({"packing": True}, model)
    assert any("a pretrained model packs chat / prompt_completion" in e for e in errors), errors


def test_eval_steps_every_n_and_the_last():
    from ray_fsdp_backend.trainer.loop.train import is_eval_step

    opts = TrainOptions(steps=25, eval_every=10)
    assert [s for s in range(1, 26) if is_eval_step(s, opts)] == [10, 20, 25]
    assert [s for s in range(1, 26) if is_eval_step(s, TrainOptions(steps=25))] == [25]


def test_held_out_records_are_a_seeded_fraction_of_their_text():
    from ray_fsdp_backend.sft.records import RawRecord, is_held_out

    records = [RawRecord(f"f:{i}", json.dumps({"text": str(i)})) for i in range(2000)]
    held = [i for i, r in enumerate(records) if is_held_out(r, 0.1, seed=3)]
    assert 150 < len(held) < 250
    moved = [RawRecord(f"other:{i + 7}", r.text) for i, r in enumerate(records)]
    assert held == [i for i, r in enumerate(moved) if is_held_out(r, 0.1, seed=3)]
    assert held != [i for i, r in enumerate(records) if is_held_out(r, 0.1, seed=4)]
    assert not any(is_held_out(r, None, seed=3) for r in records)


def _rows(n: int, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` rfb.sft_dataset-like rows: two documents each, the first's prompt masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n, seq), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    positions = torch.cat([torch.arange(5), torch.arange(seq - 5)]).expand(n, seq)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _batches(rows: dict[str, torch.Tensor], size: int):
    n = len(rows["input_ids"])
    return [{k: v[i : i + size] for k, v in rows.items()} for i in range(0, n, size)]


def test_every_rank_runs_as_many_eval_batches_and_together_they_hold_every_target():
    from ray_fsdp_backend.trainer.data.sft_batches import eval_batches, to_micro_batch

    rows, micro, dp = _rows(7), 2, 3  # 7 rows over 3 ranks of 2: the last block short
    per_rank = [list(eval_batches(_batches(rows, micro * dp), micro, r, dp)) for r in range(dp)]
    assert [len(b) for b in per_rank] == [2, 2, 2]
    assert all(len(b["input_ids"]) == micro for rank in per_rank for b in rank)
    targets = to_micro_batch(rows)["targets"]
    got = torch.cat([b["targets"] for rank in per_rank for b in rank])
    assert (got != -100).sum() == (targets != -100).sum()
    # A document's last token predicts nothing of the next document.
    assert (targets[:, 4] == -100).all() and (targets[:, 3] == rows["labels"][:, 4]).all()


def test_eval_loss_is_the_token_mean_of_the_held_out_set():
    """Single process: :func:`evaluate` over padded dp-rank shares (summed
    as the all-reduce would) equals cross-entropy's mean over every target."""
    from ray_fsdp_backend.trainer.data.sft_batches import eval_batches, to_micro_batch
    from ray_fsdp_backend.trainer.loop.evaluation import evaluate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    model.train()
    rows, micro, dp = _rows(5, seed=1), 2, 2

    def sums(batch):
        logits = model(batch["input_ids"])
        token_sum = F.cross_entropy(
            logits.flatten(0, 1), batch["targets"].flatten(), reduction="sum"
        )
        return token_sum, (batch["targets"] != -100).sum()

    shares = [
        evaluate(model, eval_batches(_batches(rows, micro * dp), micro, r, dp), sums, "cpu")
        for r in range(dp)
    ]
    assert model.training  # the mode is restored
    whole = to_micro_batch(rows)
    with torch.no_grad():
        logits = model(whole["input_ids"])
        ref = F.cross_entropy(logits.flatten(0, 1), whole["targets"].flatten())
    one = evaluate(model, eval_batches(_batches(rows, micro), micro, 0, 1), sums, "cpu")
    assert one == pytest.approx(float(ref), rel=1e-6)
    # Without a process group each rank's value is its share's own mean; the
    # shares' token sums add up to the whole: check through the counts.
    counts = [
        sum(int((b["targets"] != -100).sum()) for b in eval_batches(_batches(rows, 4), 2, r, 2))
        for r in range(dp)
    ]
    total = sum(counts)
    assert sum(s * c for s, c in zip(shares, counts, strict=True)) / total == pytest.approx(
        float(ref), rel=1e-6
    )


@pytest.fixture(scope="module")
def chat_checkpoints(tmp_path_factory):
    """A tiny Llama with a chat template, one without, and the chat data."""
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_chat_data, save_tiny_pretrained

    root = tmp_path_factory.mktemp("sft")
    chat = save_tiny_pretrained("llama", root / "chat", chat=True)
    plain = save_tiny_pretrained("llama", root / "plain")
    return chat, plain, save_tiny_chat_data(root / "data")


def _sft_errors(model: str, path: str, **data) -> list[str]:
    doc = {
        "distributed": {},
        "model": {"pretrained": model, "seq_len": 128},
        "data": {"format": "chat", "path": path, "packing": True, **data},
    }
    return check_spec(doc)


def test_packed_chat_records_on_a_pretrained_model_are_accepted(chat_checkpoints):
    """The refusals this lifts: a pretrained model on records, packed."""
    chat, _, files = chat_checkpoints
    assert _sft_errors(chat, files["train"], eval_path=files["eval"]) == []


def test_bad_records_are_named_before_ray_starts(chat_checkpoints, tmp_path):
    chat, plain, files = chat_checkpoints
    empty, text = tmp_path / "empty.jsonl", tmp_path / "notes.txt"
    empty.write_text("")
    text.write_text("not json\n")
    cases = [
        (_sft_errors(chat, files["train"], messages_field="turns"), ["data.path=", "'turns'"]),
        (_sft_errors(plain, files["train"]), ["data.path=", "chat_template"]),
        (_sft_errors(chat, str(empty)), ["data.path=", "empty.jsonl"]),
        (_sft_errors(chat, str(text)), ["data.path=", "notes.txt"]),
        (_sft_errors(chat, files["train"], eval_path=str(empty)), ["data.eval_path=", "empty"]),
    ]
    for errors, words in cases:
        assert len(errors) == 1 and all(w in errors[0] for w in words), (words, errors)


MARKED_CHATML = (
    "{% if marker is not defined %}{{ raise_exception('no marker') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML that refuses to render without the keyword argument ``marker``."""


def test_data_chat_template_and_its_kwargs_reach_the_driver_check(chat_checkpoints, tmp_path):
    """A checkpoint without a template trains chat records with
    ``data.chat_template`` (a string or a file), rendered with
    ``data.chat_template_kwargs``."""
    _, plain, files = chat_checkpoints
    path = tmp_path / "marked.jinja"
    path.write_text(MARKED_CHATML)
    kwargs = {"marker": "on"}
    for template in (MARKED_CHATML, str(path)):
        errors = _sft_errors(
            plain, files["train"], chat_template=template, chat_template_kwargs=kwargs
        )
        assert errors == []
    (error,) = _sft_errors(plain, files["train"], chat_template=str(path))
    assert "data.path=" in error and "no marker" in error


class _Rows:
    """A data source with ``iter_torch_batches`` over fixed rows (what a
    Ray Data shard gives, in one order)."""

    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows, self.reads = rows, 0

    def iter_torch_batches(self, batch_size: int, drop_last: bool, **shuffle):
        # The order as given: the streamed epoch shuffle is tested on Ray Data
        # (tests/e2e/test_sft_split.py).
        self.reads += 1
        batches = _batches(self.rows, batch_size)
        return iter(batches[: len(self.rows["input_ids"]) // batch_size] if drop_last else batches)


def test_sft_batches_resume_where_the_checkpoint_left_off():
    """Killed after 3 micro-batches (of 2 rows, dp 1), a restart from the
    state reads the rest of the epoch and the next, as the whole run does."""
    from ray_fsdp_backend.trainer.data.sft_batches import SftBatches

    shard = _Rows(_rows(10, seed=2))
    whole = SftBatches(shard, 2, seq_len=8)
    reference = [whole.next_batch() for _ in range(8)]
    first = SftBatches(shard, 2, seq_len=8)
    for _ in range(3):
        first.next_batch()
    resumed = SftBatches(shard, 2, seq_len=8)
    resumed.load_state_dict(first.state_dict())
    rest = [resumed.next_batch() for _ in range(5)]
    for got, want in zip(rest, reference[3:], strict=True):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert set(rest[0]) == {"input_ids", "targets", "position_ids"}


def _row_ids(batches) -> list[int]:
    """Which rows of ``_rows`` (numbered in ``input_ids[:, 0]``) each batch holds, in order."""
    return [int(i) for b in batches for i in b["input_ids"][:, 0]]


def test_held_rows_are_read_once_reshuffled_each_epoch_and_resumed():
    """A small dataset's shard (``hold_rows``): read from Ray Data once, each
    epoch a seeded permutation of its rows (two epochs differ, the tail left
    out differs), and a restart inside epoch 2 reads the rest of that
    epoch's order, as the uninterrupted run does."""
    from ray_fsdp_backend.trainer.data.sft_batches import SftBatches

    rows = _rows(11, seed=2)
    rows["input_ids"][:, 0] = torch.arange(11)  # each row's number

    def reader(**kw):
        shard = _Rows(rows)
        return shard, SftBatches(shard, 2, seq_len=8, seed=4, hold_rows=True, **kw)

    shard, whole = reader()
    run = [whole.next_batch() for _ in range(15)]  # 5 micro-batches an epoch, 3 epochs
    assert shard.reads == 1  # one Ray Data execution for every epoch
    epochs = [_row_ids(run[e * 5 : e * 5 + 5]) for e in range(3)]
    assert all(len(set(e)) == 10 and set(e) <= set(range(11)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
    assert len({tuple(sorted(e)) for e in epochs}) > 1  # not always the same row left out
    _, again = reader()  # a restart from step 0: the same orders
    assert _row_ids(again.next_batch() for _ in range(15)) == sum(epochs, [])

    _, first = reader()
    for _ in range(7):  # killed in epoch 2, after 2 of its micro-batches
        first.next_batch()
    shard, resumed = reader()
    resumed.load_state_dict(first.state_dict())
    rest = [resumed.next_batch() for _ in range(8)]
    for got, want in zip(rest, run[7:], strict=True):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert shard.reads == 1
