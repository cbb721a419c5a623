"""Tensor-parallel collectives per decoder block, counted, as torchtitan's.

On 2 gloo ranks (tp 2, one spawn) a dispatch mode records every c10d
collective of a forward and backward, with its phase and the tensor it
carries. One more block (2 blocks minus 1) must add exactly: with sequence
parallelism one all-gather and one reduce-scatter per attention and per MLP
in forward, and again in backward; without, one all-reduce each in forward
and in backward; with activation checkpointing the forward's again in
backward, less the MLP's output reduction. The bytes one rank sends for
them (ring) equal ``estimate_tp_block_traffic``, what ``ray-fsdp plan``
prints. Cases: the example decoder with and without sequence parallelism,
each also checkpointed, and a transformers Llama (its hidden states passed
as ``hidden_states=``). Every case's gradients equal one process's on the
same weights and data.

Column-wise layers fed plain tensors each all-reduce their own input
gradient: the backward then shows 5 all-reduces per block (q, k, v, gate,
up), which fails here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from benchmarks._collectives import CollectiveLog
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.planning.memory import ActivationShape, estimate_tp_block_traffic
from ray_fsdp_backend.strategies.blocks import apply_activation_checkpointing, find_blocks
from ray_fsdp_backend.strategies.tensor_parallel import (
    TPOptions,
    apply_tensor_parallel,
    resolve_tp_plan,
)
from tests.dist.harness import run_ranks
from tests.hf_models import VOCAB, input_ids, tiny_config

pytest.importorskip("transformers")

TP, BATCH, SEQ = 2, 2, 16
DECODER = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, seq_len=SEQ)
# name: (model, sequence_parallel, checkpointing)
CASES = {
    "decoder_sp": ("decoder", True, False),
    "decoder": ("decoder", False, False),
    "decoder_sp_checkpointed": ("decoder", True, True),
    "decoder_checkpointed": ("decoder", False, True),
    "llama": ("llama", False, False),
}
ONE_PAIR_EACH = {"all_gather": 2, "reduce_scatter": 2}  # attention and MLP
SP = {"forward": ONE_PAIR_EACH, "backward": ONE_PAIR_EACH}
PLAIN = {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
# Checkpointed: backward recomputes the forward's, less the MLP's output
# reduction (torch's checkpoint stops once the saved tensors are back).
EXPECTED = {
    "decoder_sp": SP,
    "decoder": PLAIN,
    "decoder_sp_checkpointed": {**SP, "backward": {"all_gather": 4, "reduce_scatter": 3}},
    "decoder_checkpointed": {**PLAIN, "backward": {"all_reduce": 3}},
    "llama": PLAIN,
}


def _model(kind: str, layers: int):
    if kind == "decoder":
        return Transformer(replace(DECODER, n_layers=layers))
    import transformers as tf

    config = tiny_config("llama")
    config.num_hidden_layers = layers
    return tf.LlamaForCausalLM(config)


def _loss(model, tokens):
    out = model(tokens)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits.float().pow(2).mean()


def _traffic(kind: str, layers: int, sp: bool, checkpointing: bool, mesh, tokens):
    """Collectives of one forward and backward, and the gradients."""
    torch.manual_seed(0)
    model = _model(kind, layers)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    apply_tensor_parallel(model, mesh, resolve_tp_plan(model, None), TPOptions(sp, False))
    if checkpointing:
        apply_activation_checkpointing(model, find_blocks(model))
    with CollectiveLog(phase="forward") as log:
        loss = _loss(model, tokens)
        log.phase = "backward"
        loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    return log.records, reference, grads


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _per_block(rank, world):
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    out = {}
    for name, (kind, sp, checkpointing) in CASES.items():
        tokens = input_ids(BATCH, SEQ) % (DECODER.vocab_size if kind == "decoder" else VOCAB)
        one, _, _ = _traffic(kind, 1, sp, checkpointing, mesh, tokens)
        two, state, grads = _traffic(kind, 2, sp, checkpointing, mesh, tokens)
        added = Counter(two) - Counter(one)  # the collectives of block 2
        assert Counter(one) <= Counter(two), (name, one, two)
        dim = DECODER.dim if kind == "decoder" else tiny_config("llama").hidden_size
        out[name] = {"added": added, "state": state, "grads": grads, "tokens": tokens, "dim": dim}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_per_block, TP)


def _counts(added: Counter) -> dict[str, dict[str, int]]:
    counts = {"forward": Counter(), "backward": Counter()}
    for (phase, kind, *_), n in added.items():
        counts[phase][kind] += n
    return {phase: dict(c) for phase, c in counts.items()}


@pytest.mark.parametrize("name", CASES)
def test_collectives_per_block_as_torchtitan(results, name):
    assert _counts(results[name]["added"]) == EXPECTED[name]


@pytest.mark.parametrize("name", CASES)
def test_plan_estimate_equals_the_bytes_counted(results, name):
    kind, sp, checkpointing = CASES[name]
    added = results[name]["added"].items()
    sent = sum(record.sent * n for record, n in added)
    shape = ActivationShape(
        n_layers=1,
        dim=results[name]["dim"],
        n_heads=4,
        vocab_size=VOCAB,
        seq_len=SEQ,
        micro_batch_size=BATCH,
    )
    est = estimate_tp_block_traffic(shape, tp=TP, sequence_parallel=sp, checkpointing=checkpointing)
    assert est.sent == sent
    counted = Counter()
    for phase in _counts(results[name]["added"]).values():
        counted.update(phase)
    assert est.collectives == dict(counted)


@pytest.mark.parametrize("name", CASES)
def test_gradients_equal_one_process(results, name):
    kind = CASES[name][0]
    model = _model(kind, 2)
    model.load_state_dict(results[name]["state"])
    _loss(model, results[name]["tokens"]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(results[name]["grads"][n], p.grad, rtol=1e-5, atol=1e-6)
