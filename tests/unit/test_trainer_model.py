"""The example decoder: parameter counts, meta-device init, causality, config checks."""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.models.decoder import ModelConfig, Transformer

SMALL = dict(dim=32, n_layers=2, n_heads=4, seq_len=16)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_param_counts_match_the_module(tie, kv_heads):
    cfg = ModelConfig(**SMALL, tie_embeddings=tie, n_kv_heads=kv_heads)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert sum(p.numel() for p in model.layers[0].parameters()) == cfg.block_params()
    matrices = sum(p.numel() for n, p in model.named_parameters() if "layers" in n and p.ndim == 2)
    assert matrices == cfg.matrix_params()


def test_tied_head_is_the_embedding_parameter():
    model = Transformer(ModelConfig(**SMALL, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = Transformer(ModelConfig(**SMALL, tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_blocks_are_a_module_list_named_layers():
    model = Transformer(ModelConfig(**SMALL))
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 2


def test_meta_model_materialised_with_to_empty_and_init_weights_matches_eager():
    cfg = ModelConfig(**SMALL)
    eager = Transformer(cfg)
    torch.manual_seed(0)
    eager.init_weights()
    with torch.device("meta"):
        lazy = Transformer(cfg)
    assert lazy.rope_cos.is_meta
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.init_weights()
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # Non-persistent rotary tables are rebuilt, not left as uninitialised memory.
    assert torch.equal(lazy.rope_cos, eager.rope_cos)
    assert torch.equal(lazy.rope_sin, eager.rope_sin)
    assert "rope_cos" not in lazy.state_dict()


def test_forward_is_causal_and_loss_starts_near_uniform():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SMALL)).eval()
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_too_long_sequence_is_refused():
    model = Transformer(ModelConfig(**SMALL))
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_presets_span_tiny_to_a_billion():
    assert ModelConfig.preset("tiny").num_params() < 2e6
    assert 0.9e9 < ModelConfig.preset("1b").num_params() < 1.2e9
    cfg = ModelConfig.from_dict({"preset": "small", "n_layers": 2})
    assert cfg.n_layers == 2 and cfg.dim == 512


@pytest.mark.parametrize(
    "values, match",
    [
        ({"dim": 30, "n_heads": 4}, "not a multiple of model.n_heads"),
        ({"n_layers": 0}, "n_layers=0"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads=3"),
        ({"dim": 12, "n_heads": 4}, "must be even"),
        ({"depth": 4}, "unknown model config key"),
        ({"preset": "huge"}, "huge"),
    ],
)
def test_bad_model_configs_name_the_key(values, match):
    with pytest.raises((ValueError, KeyError), match=match):
        ModelConfig.from_dict(values)


def test_init_weights_reties_the_head_that_to_empty_untied():
    with torch.device("meta"):
        model = Transformer(ModelConfig(**SMALL, tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == model.cfg.num_params()
