"""Random initialisation of sharded parameters on CPU meshes, equal to one process's.

On GPU meshes torch's offset-based RNG tracker gives each shard of a DTensor
its own part of one random stream. CPU meshes have no such tracker in torch
2.13 (``torch.distributed.tensor._random.is_rng_supported_mesh`` is False
for them and warns): a random fill of a DTensor fills each rank's local
shard from that rank's own CPU generator, so ranks seeded alike give every
shard the same values, and a weight sharded over 2 ranks starts with two
equal halves, a model no single process would build, that changes with the
world size.

:func:`single_process_rng_on_cpu_meshes` makes a random fill of a CPU-mesh
DTensor fill a full-size tensor from the rank's generator and keep this
rank's part of it. Every rank draws what one process would, in the same
order, so the sharded model equals the one-process model from the same
seed, at any world size and layout, with no communication. It costs one
full-size temporary per parameter while it is filled: nothing for the CPU
models this path serves (GPU meshes never enter it).
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
    """Random in-place fills of CPU-mesh DTensors draw the full tensor.

    A dispatch mode sees each fill as one aten op (``nn.init`` functions
    reach it through ``Tensor.uniform_`` and the like) before DTensor does.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (
            func.overloadpacket not in _RANDOM_FILLS
            or not isinstance(target, DTensor)
            or target.device_mesh.device_type != "cpu"
        ):
            return func(*args, **kwargs)
        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(full, *args[1:], **kwargs)
        # src_data_rank=None: every rank holds the same full tensor, so each
        # keeps its own part without communication.
        mine = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        local.copy_(mine.to_local())
        return target


@contextlib.contextmanager
def single_process_rng_on_cpu_meshes(device: torch.device | str) -> Iterator[None]:
    """Within it, random fills of CPU-mesh DTensors give the values one
    process gives from the same generator state (see the module docstring).
    Entered only when ``device``, where parameters are materialised, is the
    CPU; even then DTensors of GPU meshes (CPU offload) pass through to
    torch's RNG tracker."""
    if torch.device(device).type != "cpu":
        yield
        return
    with _FullDrawMode():
        yield
