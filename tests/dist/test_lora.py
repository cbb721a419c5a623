"""LoRA on a sharded frozen base, on real gloo ranks, against single-process ``peft``.

Two spawns for the module (the time budget): 4 ranks load under full_shard,
HSDP 2 x 2 and DDP (logits equal ``from_pretrained``'s), train and save a
checkpoint; 2 ranks run everything else under full_shard, HSDP 2 x 1 and DDP:
the bf16 base, AdamW steps equal to one process, adapter-only gradients and
optimizer state, the checkpoint's size, exact resume, the 4 -> 2 reshard, the
refusals, and both exports, which the test process reloads with ``peft`` and
``transformers``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
from ray_fsdp_backend.checkpoint import (
    CheckpointMismatchError,
    CheckpointStore,
    find_latest,
    load_sharded,
    save_sharded,
)
from tests.dist.harness import run_ranks
from tests.hf_models import input_ids, save_tiny_pretrained

pytest.importorskip("peft")

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
GLOBAL_BATCH = 4
STEPS = 3
CONFIGS = {
    "full_shard": dict(use_fsdp=True),
    "hybrid_shard": dict(use_fsdp=True, fsdp_sharding_strategy="hybrid_shard"),
    "ddp": dict(use_fsdp=False),
}


def _peft_model(path, *, dtype=torch.float32, meta=True, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if meta:
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return get_peft_model(base, LoraConfig(**{**LORA, **lora}))


def _wrap(name, rank, world, path, *, dtype=torch.float32, load=True, **lora):
    # hybrid_shard replicates across "nodes": LOCAL_WORLD_SIZE ranks shard.
    local = max(1, world // 2) if name == "hybrid_shard" else world
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    config = FSDPConfig(use_mixed_precision=False, **CONFIGS[name])
    strategy = build_strategy(config, device=torch.device("cpu"), local_rank=rank)
    model = strategy.wrap(_peft_model(path, dtype=dtype, **lora))
    if load:
        load_pretrained(model, path)
    return strategy, model


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def _trainable(model) -> dict[str, torch.Tensor]:
    """Trainable parameters as full tensors, keyed without DDP's ``module.``."""
    inner = getattr(model, "module", model)
    return {n: _full(p) for n, p in inner.named_parameters() if p.requires_grad}


def _logits(model, ids=None) -> torch.Tensor:
    with torch.no_grad():
        return _full(model(input_ids() if ids is None else ids).logits)


def _loss(model, ids):
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _train(strategy, model, opt, rank, world, steps, first=0) -> list[float]:
    """AdamW steps, rank ``rank`` taking its rows of each step's global batch."""
    losses, per = [], GLOBAL_BATCH // world
    for step in range(first, first + steps):
        ids = input_ids(batch=GLOBAL_BATCH, seed=10 + step)[rank * per : (rank + 1) * per]
        loss = _loss(model, ids)
        loss.backward()
        strategy.clip_grad_norm(model, 1.0, optimizer=opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().reshape(1)
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


# -- 4 ranks ---------------------------------------------------------------------------


def _four_ranks(rank, world, path, root):
    logits = {name: _logits(_wrap(name, rank, world, path)[1]) for name in CONFIGS}
    strategy, model = _wrap("full_shard", rank, world, path)
    start = _trainable(model)
    opt = _optimizer(model)
    _train(strategy, model, opt, rank, world, 2)
    save_sharded(CheckpointStore.local(root), model, opt, extra_state={"step": 2})
    return logits, start


# -- 2 ranks ---------------------------------------------------------------------------


def _two_ranks(rank, world, path, root4, root2, path_bf16):
    out = {"resumed": _resume_four(rank, world, path, root4)}
    # bf16 frozen base, fp32 adapters in the same FSDP units.
    _, model = _wrap("full_shard", rank, world, path, dtype=torch.bfloat16)
    dtypes = {p.dtype: p.requires_grad for p in model.parameters()}
    out["bf16"] = (_logits(model), dtypes)
    out["bf16_export"] = _export_bf16_checkpoint(rank, world, path_bf16, root2)

    for name in CONFIGS:
        strategy, model = _wrap(name, rank, world, path)
        out[f"{name}/logits"] = _logits(model)
        start, opt = _trainable(model), _optimizer(model)
        losses = _train(strategy, model, opt, rank, world, STEPS)
        out[f"{name}/train"] = (start, losses, _trainable(model))
        if name == "full_shard":
            out["memory"] = _memory(model, opt, world)
            out.update(_checkpoint_and_export(rank, world, path, model, opt, root2))
    out["dmuon"] = _dmuon_step(rank, world, path)
    return out


def _export_bf16_checkpoint(rank, world, path_bf16, root):
    """Adapters over a bf16 checkpoint's base exported as PEFT: without
    ``dtype=`` (their own fp32, as peft's save_pretrained) and with bf16."""
    from ray_fsdp_backend.hf import export_model

    _, model = _wrap("full_shard", rank, world, path_bf16, dtype=torch.bfloat16)
    export_model(model, os.path.join(root, "peft_bf16"), format="peft")
    export_model(model, os.path.join(root, "peft_bf16_cast"), format="peft", dtype=torch.bfloat16)
    return _trainable(model)


def _dmuon_step(rank, world, path):
    """DMuon plans the trainable matrices only; one step moves the adapters."""
    from ray_fsdp_backend import dmuon

    config = FSDPConfig(use_fsdp=True, use_dmuon=True, use_mixed_precision=False)
    strategy = build_strategy(config, device=torch.device("cpu"), local_rank=rank)
    model = strategy.wrap(_peft_model(path))
    load_pretrained(model, path)
    opt = dmuon.Muon(model, lr=0.02, ns_dtype=torch.float32)
    before = _trainable(model)
    _train(strategy, model, opt, rank, world, 1)
    return opt.param_names, before, _trainable(model)


def _resume_four(rank, world, path, root4):
    """The 4-rank checkpoint (after 2 steps) onto 2 ranks, then step 3."""
    strategy, model = _wrap("full_shard", rank, world, path)
    opt = _optimizer(model)
    extra = load_sharded(
        CheckpointStore.local(root4), find_latest(CheckpointStore.local(root4)), model, opt
    )
    losses = _train(strategy, model, opt, rank, world, 1, first=2)
    return extra, losses, _trainable(model)


def _checkpoint_and_export(rank, world, path, model, opt, root):
    store = CheckpointStore.local(root)
    save_sharded(store, model, opt, extra_state={"step": STEPS})
    errors = {}
    for label, kwargs in [("random_base", dict(load=False)), ("rank8", dict(r=8))]:
        _, other = _wrap("full_shard", rank, world, path, **kwargs)
        try:
            load_sharded(store, find_latest(store), other, _optimizer(other))
        except CheckpointMismatchError as exc:
            errors[label] = str(exc)
    from ray_fsdp_backend.hf import export_model

    export_model(model, os.path.join(root, "peft"), format="peft")
    export_model(model, os.path.join(root, "merged"), format="hf", dtype=torch.float32)
    # The adapter directory back into a freshly loaded base.
    _, reloaded = _wrap("full_shard", rank, world, path)
    load_pretrained(reloaded, os.path.join(root, "peft"))
    return {"errors": errors, "trained": _logits(model), "reloaded": _logits(reloaded)}


def _memory(model, opt, world):
    """Which parameters get gradients and optimizer state; local share of the base."""
    _loss(model, input_ids(batch=GLOBAL_BATCH // world)).backward()
    grads = {id(p) for p in model.parameters() if p.grad is not None}
    opt.zero_grad(set_to_none=True)
    frozen_local = sum(p.to_local().numel() for p in model.parameters() if not p.requires_grad)
    frozen_total = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    with_state = {id(p) for p in opt.state}
    return dict(
        frozen_with_grad=sum(id(p) in grads for p in model.parameters() if not p.requires_grad),
        trainable_without_grad=sum(
            id(p) not in grads for p in model.parameters() if p.requires_grad
        ),
        frozen_share=frozen_local / frozen_total,
        frozen_with_state=sum(
            id(p) in with_state for p in model.parameters() if not p.requires_grad
        ),
        trainable_without_state=sum(
            id(p) not in with_state for p in model.parameters() if p.requires_grad
        ),
    )


# -- the test ----------------------------------------------------------------------------


def _reference(path, start, steps=STEPS, first=0):
    """Single-process peft from the same adapter weights on the same global batches."""
    model = _peft_model(path, meta=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(start[name])
    opt = _optimizer(model)
    losses = []
    for step in range(first, first + steps):
        ids = input_ids(batch=GLOBAL_BATCH, seed=10 + step)
        loss = _loss(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _base_logits(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)(input_ids()).logits


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_pretrained("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def ckpt4(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt4"))


@pytest.fixture(scope="module")
def four(llama, ckpt4):
    return run_ranks(_four_ranks, 4, llama, ckpt4)


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt2"))


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_bf16")
    return save_tiny_pretrained("llama", path, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def two(llama, four, ckpt4, ckpt2, llama_bf16):
    return run_ranks(_two_ranks, 2, llama, ckpt4, ckpt2, llama_bf16)


def test_logits_after_load_equal_the_base_model(llama, four, two):
    four_logits = four[0]
    want = _base_logits(llama)
    for name in CONFIGS:
        torch.testing.assert_close(four_logits[name], want, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(two[f"{name}/logits"], want, atol=1e-5, rtol=1e-5, msg=name)
    logits, dtypes = two["bf16"]
    assert dtypes == {torch.bfloat16: False, torch.float32: True}
    torch.testing.assert_close(logits, _base_logits(llama, torch.bfloat16), atol=0, rtol=0)


def test_adamw_steps_equal_single_process_peft(llama, two):
    for name in CONFIGS:
        start, losses, end = two[f"{name}/train"]
        assert start and all(float(v.abs().sum()) == 0 for k, v in start.items() if "lora_B" in k)
        want_losses, want = _reference(llama, start)
        assert losses == pytest.approx(want_losses, abs=1e-5), name
        assert end.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(end[key], value, atol=2e-6, rtol=1e-5, msg=f"{name} {key}")
        assert not torch.allclose(end[key], start[key])  # it trained


def test_checkpoint_reshards_four_to_two_and_resumes_exactly(llama, four, two):
    _, start = four
    extra, losses, end = two["resumed"]
    assert extra == {"step": 2}
    want_losses, want = _reference(llama, start)
    assert losses == pytest.approx(want_losses[2:], abs=1e-5)
    for key, value in want.items():
        torch.testing.assert_close(end[key], value, atol=2e-6, rtol=1e-5, msg=key)


def test_checkpoint_holds_only_trainable_state(llama, two, ckpt2):
    import torch.distributed.checkpoint as dcp

    _, _, end = two["full_shard/train"]
    store = CheckpointStore.local(ckpt2)
    metadata = dcp.FileSystemReader(store.path(find_latest(store))).read_metadata()
    tensors = {
        k: v.size.numel() * v.properties.dtype.itemsize
        for k, v in metadata.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    assert not [k for k in tensors if "base_layer" in k or "embed_tokens" in k or "mlp" in k]
    # Each adapter, its two Adam moments and a 4-byte step count: nothing of the base.
    adapters = sum(v.numel() * 4 for v in end.values())
    assert sum(tensors.values()) == 3 * adapters + 4 * len(end)
    errors = two["errors"]
    assert "initialised at random and never loaded" in errors["random_base"]
    assert "LoRA adapters are q_proj r=4, v_proj r=4, the model's are q_proj r=8" in errors["rank8"]


def test_exports_load_with_peft_and_from_pretrained(llama, two, ckpt2):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trained = two["trained"]
    assert not torch.allclose(trained, _base_logits(llama), atol=1e-3)
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, os.path.join(ckpt2, "peft"))(input_ids()).logits
        merged_model = AutoModelForCausalLM.from_pretrained(os.path.join(ckpt2, "merged"))
        merged = merged_model(input_ids()).logits
    torch.testing.assert_close(adapted, trained, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, trained, atol=1e-5, rtol=1e-5)
    assert not any("lora" in k for k in merged_model.state_dict())
    # load_pretrained reads the adapter directory back onto a loaded base.
    torch.testing.assert_close(two["reloaded"], trained, atol=1e-6, rtol=1e-6)


def test_dmuon_plans_only_the_adapters(two):
    names, before, after = two["dmuon"]
    assert names and all(".lora_" in n for n in names)
    assert len(names) == len(before)  # every adapter is a 2-D block matrix
    assert all(not torch.equal(before[k], after[k]) for k in before if "lora_B" in k)


def test_only_adapters_get_gradients_and_optimizer_state(two):
    memory = two["memory"]
    assert memory["frozen_share"] == pytest.approx(0.5, abs=0.05)
    assert memory["frozen_with_grad"] == memory["trainable_without_grad"] == 0
    assert memory["frozen_with_state"] == 0
    assert memory["trainable_without_state"] == 0


def test_peft_export_keeps_the_adapters_dtype_as_peft_does(llama_bf16, two, ckpt2, tmp_path):
    """Over a bf16 checkpoint the adapters train in fp32: the PEFT export
    writes them in fp32 (bitwise the trained values), as peft's own
    ``save_pretrained`` does for the same model; ``dtype=`` still casts."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(llama_bf16, dtype=torch.bfloat16)
    get_peft_model(base, LoraConfig(**LORA)).save_pretrained(tmp_path)
    want = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    got = load_file(os.path.join(ckpt2, "peft_bf16", "adapter_model.safetensors"))
    cast = load_file(os.path.join(ckpt2, "peft_bf16_cast", "adapter_model.safetensors"))
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert {v.dtype for v in want.values()} == {torch.float32}
    assert {v.dtype for v in cast.values()} == {torch.bfloat16}
    trained = {k.replace(".default", ""): v for k, v in two["bf16_export"].items()}
    assert set(trained) == set(got)
    for key, value in got.items():
        assert torch.equal(value, trained[key]), key
