"""Context parallelism's pure parts, and packed rows in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ray_fsdp_backend.context_parallel import (
    IGNORE_INDEX,
    pack_documents,
    shard_sequence,
    shift_labels,
)
from ray_fsdp_backend.context_parallel.apply import disable_hf_cache
from ray_fsdp_backend.context_parallel.sequence import chunk_indices, document_ids, is_packed
from ray_fsdp_backend.context_parallel.ulysses import kv_repeat_factor
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _docs(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def test_pack_documents_restarts_positions_and_splits_long_documents():
    rows = pack_documents(_docs([3, 5, 6]), seq_len=4)
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3]]
    # the cut document continues as a new document on the next row
    assert document_ids(rows["position_ids"]).tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0] * 4]
    assert torch.equal(rows["labels"], rows["input_ids"])
    assert is_packed(rows["position_ids"]) and not is_packed(rows["position_ids"][1:])


def test_shift_labels_ignores_targets_across_documents():
    labels = torch.tensor([[10, 11, 12, 20, 21]])
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    assert shift_labels(labels).tolist() == [[11, 12, 20, 21, IGNORE_INDEX]]
    assert shift_labels(labels, positions).tolist() == [[11, 12, IGNORE_INDEX, 21, IGNORE_INDEX]]


def test_chunk_indices_contiguous_and_head_tail():
    assert chunk_indices(8, 1, 2, load_balance=False).tolist() == [4, 5, 6, 7]
    # ring: chunks r and 2cp-1-r of 2cp chunks
    assert chunk_indices(8, 0, 2, load_balance=True).tolist() == [0, 1, 6, 7]
    assert chunk_indices(8, 1, 2, load_balance=True).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not divisible by context_parallel_size = 3"):
        chunk_indices(8, 0, 3, load_balance=False)
    with pytest.raises(ValueError, match="2 x context_parallel_size = 8"):
        chunk_indices(12, 0, 4, load_balance=True)


def test_shard_sequence_shifts_before_splitting_and_makes_positions():
    ids = torch.arange(8).view(1, 8)
    other = torch.ones(1, 8)
    shards = [shard_sequence({"input_ids": ids, "labels": ids, "w": other}, r, 2) for r in (0, 1)]
    assert shards[0]["labels"].tolist() == [[1, 2, 3, 4]]  # 4 lives on rank 1: kept
    assert shards[1]["labels"].tolist() == [[5, 6, 7, IGNORE_INDEX]]
    assert shards[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert shards[1]["w"].shape == (1, 4)
    whole = torch.cat([s["input_ids"] for s in shards], dim=1)
    assert torch.equal(whole, ids)


def test_kv_repeat_factor():
    assert kv_repeat_factor(8, 8, 4) == 1
    assert kv_repeat_factor(8, 2, 4) == 2  # 2 kv heads over 4 ranks: each repeated twice
    assert kv_repeat_factor(8, 1, 2) == 2
    with pytest.raises(ValueError, match="not divisible by context_parallel_size=3"):
        kv_repeat_factor(8, 2, 3)


def _one_by_one(model_fn, docs, seq_len, rows):
    """Logits of each document run alone, cut into the packed layout."""
    logits = torch.cat([model_fn(d[None])[0] for d in docs])
    return logits[: rows * seq_len].view(rows, seq_len, -1)


def test_packed_decoder_rows_equal_documents_one_by_one():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32))
    docs = _docs([5, 9, 18, 12, 20])  # 64 tokens: two rows of 32, no document cut
    rows = pack_documents(docs, 32)
    with torch.no_grad():
        packed = model(rows["input_ids"], rows["position_ids"])
        alone = _one_by_one(model, docs, 32, 2)
    assert float((packed - alone).abs().max()) < 1e-5


def test_packed_transformers_rows_equal_documents_one_by_one_after_cache_off():
    tf = pytest.importorskip("transformers")
    from tests.hf_models import VOCAB, tiny_config

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tiny_config("llama"))  # default config: use_cache=True
    docs = _docs([5, 9, 18, 12, 20], vocab=VOCAB)
    rows = pack_documents(docs, 32)

    def run(ids, **kw):
        return model(input_ids=ids, **kw).logits

    with torch.no_grad():
        alone = _one_by_one(run, docs, 32, 2)
        trapped = run(rows["input_ids"], position_ids=rows["position_ids"])
        disable_hf_cache(model)  # what ctx.wrap does
        packed = run(rows["input_ids"], position_ids=rows["position_ids"])
    assert float((trapped - alone).abs().max()) > 1e-2  # the trap is real here
    assert float((packed - alone).abs().max()) < 1e-5
    assert model.config.use_cache is True  # an export writes the model's own config


def test_config_refuses_bad_context_parallel_layouts_by_key():
    from ray_fsdp_backend.settings.config import FSDPSettings

    with pytest.raises(ValueError, match="context_parallel_size=2 needs use_fsdp"):
        FSDPSettings(context_parallel_size=2)  # DDP
    # DMuon under cp: tests/dist/test_dmuon_model_parallel.py
    assert FSDPSettings(use_fsdp=True, use_dmuon=True, context_parallel_size=2).use_dmuon
    with pytest.raises(ValueError, match="context_parallel_backend='ringg' is not one of"):
        FSDPSettings(use_fsdp=True, context_parallel_size=2, context_parallel_backend="ringg")
    with pytest.raises(ValueError, match="context_parallel_size=0 must be a positive int"):
        FSDPSettings(use_fsdp=True, context_parallel_size=0)
    ring = FSDPSettings(use_fsdp=True, context_parallel_size=2, context_parallel_backend="ring")
    with pytest.raises(ValueError, match="context_parallel_backend=ring needs CUDA"):
        ring.check_cp_device("cpu")
    ring.check_cp_device("cuda")


def test_resolve_cp_backend():
    from ray_fsdp_backend.settings.config import FSDPSettings

    auto = FSDPSettings(use_fsdp=True, context_parallel_size=4)
    assert auto.resolve_cp_backend(8, "cpu") == "ulysses"
    assert auto.resolve_cp_backend(6, "cuda") == "ring"  # 6 heads do not split over 4
    with pytest.raises(ValueError, match="ring needs CUDA workers \\(6 heads per tp rank"):
        auto.resolve_cp_backend(6, "cpu")
    ulysses = FSDPSettings(
        use_fsdp=True, context_parallel_size=4, context_parallel_backend="ulysses"
    )
    with pytest.raises(ValueError, match="12 heads / tensor_parallel_size=2 = 6 per tp rank"):
        FSDPSettings(
            use_fsdp=True,
            context_parallel_size=4,
            tensor_parallel_size=2,
            context_parallel_backend="ulysses",
        ).resolve_cp_backend(12, "cuda")
    assert ulysses.resolve_cp_backend(8, "cpu") == "ulysses"


def test_mesh_layout_puts_cp_inside_dp_shard_and_outside_tp():
    from ray_fsdp_backend.distributed.mesh import resolve_layout
    from ray_fsdp_backend.planning.topology import topology_from_node_counts
    from ray_fsdp_backend.settings.config import FSDPSettings

    config = FSDPSettings(use_fsdp=True, context_parallel_size=2)
    layout = resolve_layout(config, topology_from_node_counts([4]))
    assert layout.axis_names == ("dp_shard", "cp") and layout.shape == (2, 2)
    assert layout.groups("cp") == ((0, 1), (2, 3))  # neighbouring ranks split a sequence
    assert layout.data_parallel_coordinates(1) == (0, 2)  # a cp group reads one batch
    assert layout.data_parallel_coordinates(2) == (1, 2)
    with pytest.raises(ValueError, match="context_parallel_size=4 needs groups of 4 ranks"):
        resolve_layout(
            FSDPSettings(use_fsdp=True, context_parallel_size=4), topology_from_node_counts([2, 2])
        )


def test_packed_batches_keep_documents_apart_and_resume():
    from ray_fsdp_backend.trainer.data.corpus import PackedBatches, load_corpus, split_documents

    tokens = load_corpus()
    docs = split_documents(tokens)
    assert torch.equal(torch.cat(docs), tokens) and all(int(d[-1]) == 10 for d in docs[:-1])
    stream = PackedBatches(tokens, 64, 2, 1, 2, seed=3)
    first = stream.next_batch()
    assert set(first) == {"input_ids", "targets", "position_ids"}
    starts = first["position_ids"][:, 1:] == 0  # a document starts at t + 1
    assert (first["targets"][:, :-1][starts] == IGNORE_INDEX).all()
    resumed = PackedBatches(tokens, 64, 2, 1, 2, seed=3, position=stream.position)
    assert torch.equal(resumed.next_batch()["input_ids"], stream.next_batch()["input_ids"])


def _spec_errors(*overrides):
    from ray_fsdp_backend.trainer.schema.spec import apply_overrides, check_spec, load_yaml

    doc = load_yaml(EXAMPLES / "long_context.yaml")
    return "\n".join(check_spec(apply_overrides(doc, list(overrides))))


def test_trainer_spec_refuses_bad_cp_layouts_before_workers_start():
    assert _spec_errors() == ""
    ring = "distributed.context_parallel_backend=ring"
    assert "data.packing with distributed.context_parallel_backend=ring" in _spec_errors(ring)
    assert "model.seq_len=511 is not divisible by context_parallel_size = 2" in _spec_errors(
        "model.seq_len=511"
    )
    assert "2 x context_parallel_size = 4" in _spec_errors(
        ring, "data.packing=false", "model.seq_len=510", "scaling.use_gpu=true"
    )
    assert "ring needs CUDA workers (3 heads per tp rank" in _spec_errors(
        "model.n_heads=3", "model.dim=96"
    )
    # Ray Data is split by dp rank (rfb.MeshDataConfig): cp groups read the same rows.
    assert not _spec_errors("data.source=ray_data", "data.path=/tmp", "data.packing=false")


def test_activation_estimate_falls_as_one_over_cp():
    from ray_fsdp_backend.planning.memory import ActivationShape, estimate_activations

    shape = ActivationShape(
        n_layers=4, dim=256, n_heads=8, vocab_size=256, seq_len=8192, micro_batch_size=1
    )
    whole = estimate_activations(shape)
    for cp in (2, 4):
        assert estimate_activations(shape, cp=cp) == pytest.approx(whole / cp, rel=1e-6)
    # 2-byte values, no scores: s b h 34 per layer plus the logits
    flash = estimate_activations(shape, value_bytes=2, attention_scores=False)
    assert flash == 4 * 8192 * 256 * 34 + 8192 * 256 * 6


def test_torch_still_has_what_ring_region_calls():
    # ring_region uses torch's private dispatcher switch (CUDA only, not run here):
    # fail loudly when an upgrade renames it rather than at a GPU user's first step.
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_impl

    assert callable(cp_impl._enable_context_parallel_dispatcher_impl)
    assert callable(cp_impl._disable_context_parallel_dispatcher_impl)
    assert isinstance(cp_impl._cp_options.enable_load_balance, bool)


def test_ring_refuses_float32_grouped_query_heads_and_packed_rows_by_name():
    from ray_fsdp_backend.context_parallel.apply import check_context_parallel

    grouped = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, seq_len=8))
    rule = "ring.*Attention with grouped-query heads \\(4 query, 2 key/value\\) in float32"
    with pytest.raises(ValueError, match=rule):
        check_context_parallel(grouped, "ring", torch.float32)
    assert check_context_parallel(grouped, "ring", torch.bfloat16).value == "ring"
    assert check_context_parallel(grouped, "ulysses", torch.float32).value == "ulysses"
    full = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, seq_len=8))
    assert check_context_parallel(full, "ring", torch.float32).value == "ring"
    rows = pack_documents(_docs([3, 9, 4]), seq_len=8)
    with pytest.raises(ValueError, match="packed rows .*context_parallel_backend='ring'"):
        shard_sequence(rows, 0, 2, load_balance=True)
    assert shard_sequence(rows, 0, 2)["input_ids"].shape == (2, 4)  # Ulysses takes them


def test_the_ring_check_of_device_rows_reads_nothing_on_the_host():
    """Rows on a device (``meta`` stands in for ``cuda``: reading it raises)
    are checked by a device-side assert, not read back once per micro-batch
    (``bool(...)`` of the packed flag was a host sync)."""
    rows = {
        "input_ids": torch.zeros(2, 8, dtype=torch.long, device="meta"),
        "position_ids": torch.arange(8, device="meta").repeat(2, 1),
    }
    assert shard_sequence(rows, 0, 2, load_balance=True)["input_ids"].shape == (2, 4)
