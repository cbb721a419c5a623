"""Random initialisation of sharded parameters held on the CPU, equal to one process's.

On GPU meshes torch's offset-based RNG tracker gives each shard of a DTensor
its own part of one random stream. CPU meshes have no such tracker in torch
2.13 (``torch.distributed.tensor._random.is_rng_supported_mesh`` is False
for them and warns): a random fill of a DTensor fills each rank's local
shard from that rank's own CPU generator, so ranks seeded alike give every
shard the same values, and a weight sharded over 2 ranks starts with two
equal halves, a model no single process would build, that changes with the
world size. A GPU mesh under ``fsdp_cpu_offload`` materialises its shards on
the CPU, where the tracker (which steps the GPU generator) does not reach:
the same equal halves, and LoRA's ``lora_A`` with duplicate rows.

:func:`single_process_rng_on_cpu_meshes` makes a random fill of a DTensor
whose shard is on the CPU fill a full-size tensor from the rank's CPU
generator and keep this rank's part of it. Every rank draws what one process
would, in the same order, so the sharded model equals the one-process model
from the same seed, at any world size and layout, with no communication. It
costs one full-size temporary per parameter while it is filled (on a GPU
mesh, also on the GPU for the split).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_RANDOM_FILLS = frozenset(
    {
        aten.normal_,
        aten.uniform_,
        aten.random_,
        aten.bernoulli_,
        aten.exponential_,
        aten.log_normal_,
        aten.cauchy_,
        aten.geometric_,
    }
)


class _FullDrawMode(TorchDispatchMode):
    """Random in-place fills of DTensors whose shard lives on the CPU (a CPU
    mesh, or a GPU mesh whose shards FSDP2 offloads) draw the full tensor.

    A dispatch mode sees each fill as one aten op (``nn.init`` functions
    reach it through ``Tensor.uniform_`` and the like) before DTensor does.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (
            func.overloadpacket not in _RANDOM_FILLS
            or not isinstance(target, DTensor)
            or target.to_local().device.type != "cpu"
        ):
            return func(*args, **kwargs)
        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(full, *args[1:], **kwargs)
        # src_data_rank=None: every rank holds the same full tensor, so each
        # keeps its own part without communication (on a GPU mesh the split
        # runs on the mesh's device, one parameter at a time).
        mine = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        local.copy_(mine.to_local())
        return target


@contextlib.contextmanager
def single_process_rng_on_cpu_meshes(device: torch.device | str) -> Iterator[None]:
    """Within it, random fills of DTensors with CPU shards give the values
    one process gives from the CPU generator's state (see the module
    docstring). Entered only when ``device``, where parameters are
    materialised, is the CPU: a CPU mesh, or a GPU mesh under
    ``fsdp_cpu_offload``, whose CPU shards torch's RNG tracker (which steps
    the GPU generator) would fill from the CPU generator alike on every
    rank."""
    if torch.device(device).type != "cpu":
        yield
        return
    with _FullDrawMode():
        yield


class _FullCopyMode(TorchDispatchMode):
    """``sharded.copy_(full)``: a plain tensor of a DTensor's global shape
    copied into it (transformers' ``init.copy_``, as Qwen3-Next's
    ``_init_weights`` fills ``A_log``) keeps this rank's part, where DTensor
    itself refuses a mixed copy. Every rank holds the same full tensor (drawn
    as one process draws it), so no communication."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target, source = (args + (None, None))[:2]
        if (
            func is not aten.copy_.default
            or not isinstance(target, DTensor)
            or not isinstance(source, torch.Tensor)
            or isinstance(source, DTensor)
            or tuple(source.shape) != tuple(target.shape)
        ):
            return func(*args, **kwargs)
        local = target.to_local()
        full = source.to(device=local.device, dtype=local.dtype)
        mine = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        local.copy_(mine.to_local())
        return target


@contextlib.contextmanager
def full_copies_into_shards() -> Iterator[None]:
    """Within it, copying a full plain tensor into a DTensor keeps this
    rank's part (see :class:`_FullCopyMode`)."""
    with _FullCopyMode():
        yield
