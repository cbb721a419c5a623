"""QLoRA's frozen base: NF4 weights (``torchao``), quantised shard by shard.

``load_pretrained(model, path, quantize="nf4")`` reads each rank's shard of
the 16/32-bit checkpoint as it always does, then this module replaces every
frozen ``nn.Linear`` weight (the output head excepted, as bitsandbytes and
torchtune leave it) by a ``torchao`` ``NF4Tensor`` of that shard: 4-bit
codes in blocks of 64 values, one 8-bit scale per block, one fp32 factor per
256 blocks (0.5 + 1/64 + 4/16384 bytes per parameter). Under FSDP2 / HSDP
the NF4 shard becomes the local tensor of the sharded parameter: FSDP2
all-gathers its codes and scales through ``NF4Tensor``'s
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, and ``F.linear`` on it
dequantises in the forward and backward (``torchao``'s ``linear_nf4``).

``to_nf4`` of a whole weight subtracts the mean of *all* its block scales
before the second quantisation. A shard quantised alone would use its own
mean; here the ranks of a shard group all-gather their block scales (1/64 of
the shard's elements) and every rank subtracts the mean of the whole weight.
With shards of a multiple of 64 x 256 elements, each rank's codes, scales
and factors are then bitwise ``to_nf4(full weight)``'s, cut at the shard
(:func:`check_nf4_shards` refuses other shapes before any weight is read).

``torchao`` is an optional extra (``pip install 'ray_fsdp_backend[qlora]'``);
it is imported here only, and this module only by ``load_pretrained`` with
``quantize=``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Re-exported: the guard lives where importing it imports no torch (the CLI's driver).
from ray_fsdp_backend.compat.optional_imports import keep_torchao_unimported  # noqa: F401
from ray_fsdp_backend.compat.peft import unwrap
from ray_fsdp_backend.ops.nf4_shards import (  # noqa: F401 (the shard rule, re-exported)
    BLOCK,
    QUANTIZATIONS,
    SCALER_BLOCK,
    SHARD_MULTIPLE,
    Target,
    check_nf4_shards,
    check_quantize,
    nf4_bytes_per_param,
    nf4_shard_problems,
)


def check_fsdp_managed(model: nn.Module, targets: list[Target]) -> None:
    """Refuse sharded weights that FSDP2 does not manage (tensor parallel):
    NF4 shards live in FSDP2's all-gather.

    Raises:
        ValueError: naming the first such weights.
    """
    inner = unwrap(model)
    managed = {key for key, _ in _fsdp_params(inner)}
    params = dict(inner.named_parameters())
    bad = [
        t.name
        for t in targets
        if isinstance(params[t.name], DTensor) and id(params[t.name]) not in managed
    ]
    if bad:
        raise ValueError(
            f"quantize='nf4' needs FSDP2 / HSDP to shard the base; {len(bad)} weights are "
            f"DTensors it does not manage (tensor parallel?): {', '.join(bad[:5])}"
        )


def nf4_targets(model: nn.Module) -> list[Target]:
    """The frozen 2-D ``nn.Linear`` weights of ``model`` but its output head's
    (a LoRA layer on the head included: its ``base_layer`` stays dense, in
    the dtype it was loaded in, as bitsandbytes leaves it)."""
    inner = unwrap(model)
    head = getattr(inner, "get_output_embeddings", lambda: None)()
    dense = {id(m) for m in head.modules()} if isinstance(head, nn.Module) else set()
    targets = []
    for name, module in inner.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or id(module) in dense or weight is None:
            continue
        if weight.requires_grad or weight.ndim != 2:
            continue
        shard = weight.to_local().shape if isinstance(weight, DTensor) else weight.shape
        shards = _shard_count(weight)
        key = f"{name}.weight" if name else "weight"
        targets.append(Target(key, tuple(weight.shape), tuple(shard), shards))
    return targets


def _shard_count(weight: torch.Tensor) -> int:
    if not isinstance(weight, DTensor):
        return 1
    count = 1
    for size, placement in zip(weight.device_mesh.shape, weight.placements, strict=True):
        if placement.is_shard():
            count *= size
    return count


def quantize_shard(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``to_nf4`` of this rank's ``local`` shard with the whole weight's scale mean.

    ``group``: the ranks holding the other shards, in dim-0 order (None: the
    shard is the whole weight). Collective over ``group``.
    """
    from torchao.quantization import to_nf4
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import get_block_absmax

    nf4 = to_nf4(local.contiguous(), BLOCK, SCALER_BLOCK)  # codes, layout, metadata
    scalers = get_block_absmax(local.flatten(), BLOCK)
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(scalers) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, scalers, group=group)
        mean = torch.cat(parts).mean()
    else:
        mean = scalers.mean()
    nf4.quantized_scalers, nf4.quantization_factor = _double_quantize(scalers - mean)
    nf4.scaler_mean = mean
    return nf4


def _double_quantize(centred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``NF4Tensor.double_quantize_scalers`` (torchao 0.18) after its mean step,
    op for op, so the result is bitwise the same."""
    blocks = centred.view(-1, SCALER_BLOCK)
    absmax = blocks.abs().max(dim=1).values
    factor = 256 / (2 * absmax.unsqueeze(-1).expand_as(blocks))
    codes = (blocks * factor).round().clamp(-128, 127)
    return codes.flatten().to(torch.int8), factor[:, 0].contiguous()


def apply_nf4(model: nn.Module, targets: list[Target]) -> None:
    """Replace each target weight's (local) data by its NF4 shard, in place.

    An FSDP2 parameter keeps its ``DTensor`` (the optimizer and state dict
    see the same object); its local tensor becomes the ``NF4Tensor`` and
    FSDP2's record of it is reset, so the next all-gather runs through the
    NF4 hooks. A plain parameter is replaced by an NF4 one. Collective.
    """
    inner = unwrap(model)
    fsdp = dict(_fsdp_params(inner))
    params = dict(inner.named_parameters())
    for target in targets:
        weight = params[target.name]
        with torch.no_grad():
            if isinstance(weight, DTensor):
                fsdp_param = fsdp[id(weight)]
                group = fsdp_param.shard_mesh.get_group()
                _swap_fsdp_local(fsdp_param, quantize_shard(weight.to_local(), group))
            else:
                module_name, _, leaf = target.name.rpartition(".")
                nf4 = nn.Parameter(quantize_shard(weight, None), requires_grad=False)
                setattr(inner.get_submodule(module_name), leaf, nf4)


def _fsdp_params(model: nn.Module) -> Iterator[tuple[int, object]]:
    """id(sharded parameter) -> its ``FSDPParam``: FSDP2's private records
    (torch 2.13 ``_fully_shard._fsdp_param``), read in this one place."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            yield id(fsdp_param.sharded_param), fsdp_param


def _swap_fsdp_local(fsdp_param, nf4: torch.Tensor) -> None:
    # What FSDPParam.reset_sharded_param does after load_state_dict(assign=True),
    # for a local tensor with all-gather extensions (torch 2.13): the sharded
    # DTensor holds the new local tensor, the flat data view FSDP2 keeps for
    # its default all-gather goes, and _init_extensions records the hooks.
    fsdp_param.sharded_param._local_tensor = _packed_nf4_class()(*_nf4_args(nf4))
    fsdp_param._sharded_param_data = fsdp_param.sharded_param._local_tensor
    fsdp_param._init_extensions()
    fsdp_param.all_gather_outputs = []


def _nf4_args(nf4) -> tuple:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import construct_nf4_args

    return construct_nf4_args(nf4)


@functools.cache  # one class, built on first use: torchao is imported only then
def _packed_nf4_class() -> type:
    """``NF4Tensor`` whose FSDP2 all-gather moves one byte tensor.

    torch 2.13's FSDP2 with a shard group of one rank (one process, or HSDP
    with ``dp_shard`` 1) skips the all-gather and hands an extension only the
    first of its all-gather inputs (``FSDPParamGroup.wait_for_unshard``);
    ``NF4Tensor`` has three (codes, scales, factors). Packed as bytes into
    one, every shard count takes the same path; the unsharded weight is
    ``torchao``'s ``NF4Tensor``.
    """
    from torchao.quantization import NF4Tensor

    class PackedNF4Tensor(NF4Tensor):
        def fsdp_pre_all_gather(self, mesh):
            parts = (self.quantized_data, self.quantized_scalers, self.quantization_factor)
            packed = torch.cat([_bytes(t) for t in parts])
            sizes = [t.numel() * t.element_size() for t in parts]
            return (packed,), (self, sizes, mesh.size())

        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            shard, sizes, world = metadata
            rows = outputs[0].view(world, -1).split(sizes, dim=1)
            dtypes = [getattr(shard, name).dtype for name in _SHARDED_PARTS]
            # cat copies: the parts must own their storage, which FSDP2 frees
            # and re-allocates apart from the all-gather output's.
            parts = [torch.cat(r.unbind(0)).view(d) for r, d in zip(rows, dtypes, strict=True)]
            if out is not None:
                for name, part in zip(_SHARDED_PARTS, parts, strict=True):
                    getattr(out, name).copy_(part)
                return None
            size = torch.Size((shard.size(0) * world, *shard.shape[1:]))
            whole = NF4Tensor(*_whole_args(shard, size, parts))
            return whole, tuple(getattr(whole, name) for name in _SHARDED_PARTS)

    return PackedNF4Tensor


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.stride() != (1,):  # torchao's one-element factors keep a stride of 256
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


_SHARDED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")


def _whole_args(shard, size: torch.Size, parts: list[torch.Tensor]) -> tuple:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import construct_nf4_args

    attrs = dict(zip(_SHARDED_PARTS, parts, strict=True), size=size, stride=(size[1], 1))
    attrs["n_blocks"] = shard.n_blocks * size[0] // shard.size(0)
    return construct_nf4_args(shard, attrs)


def nf4_bytes(model: nn.Module) -> Mapping[str, int]:
    """Bytes this rank holds for the frozen base, by kind: ``"nf4"`` (codes,
    scales and factors of the NF4 weights' local shards) and ``"dense"``
    (every other frozen parameter's local shard)."""
    out = {"nf4": 0, "dense": 0}
    for p in unwrap(model).parameters():
        if p.requires_grad:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        if hasattr(local, "quantized_data"):
            inner = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
            out["nf4"] += sum(t.numel() * t.element_size() for t in inner)
        else:
            out["dense"] += local.numel() * local.element_size()
    return out


def dequantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every NF4 tensor (or the NF4 local shard of a ``DTensor``)
    dequantised to its dtype, shard by shard: the merged export writes the
    base as the NF4 codes give it back (it differs from the checkpoint the
    base was read from by the quantisation error; docs/lora.md)."""
    out = {}
    for key, value in state.items():
        local = value._local_tensor if isinstance(value, DTensor) else value
        if not hasattr(local, "quantized_data"):
            out[key] = value
            continue
        dense = local.get_original_weight()
        if isinstance(value, DTensor):
            dense = DTensor.from_local(
                dense, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
            )
        out[key] = dense
    return out
