"""Ring attention through torch's ``context_parallel`` (CUDA only).

For cp sizes beyond the attention heads (Ulysses needs ``heads % cp == 0``)
or cp groups that span nodes (a ring exchanges with neighbours only).
torch's ring dispatches the CUDA flash / memory-efficient / cuDNN SDPA
kernels, takes no attention mask (so no packed rows), and on CPU fails
("no sharding strategy" for the CPU flash kernel, "mixed torch.Tensor and
DTensor" under the math kernel, pytorch#147793, torch 2.13): the backend
refuses ``ring`` on CPU and with packing before workers start. On CUDA it
runs the flash (bf16/fp16) or memory-efficient (no grouped-query heads)
kernel only, raising "CP only supports flash attention and memory efficient
attention now" otherwise: ``ctx.wrap`` refuses fp32 grouped-query attention
and ``ctx.shard_sequence`` packed rows, by name, before any step
(:func:`~ray_fsdp_backend.context_parallel.apply.check_context_parallel`).
tests/dist/test_ring_gpu.py runs it on two GPUs.

Shards are head-tail load balanced
(:func:`~ray_fsdp_backend.context_parallel.sequence.chunk_indices` with
``load_balance=True``, the order of torch's ``_HeadTailLoadBalancer``), so
the causal ring gives every rank the same work. torch's public
``context_parallel(mesh, buffers=...)`` shards buffers itself and needs at
least one; ``ctx.shard_sequence`` has already sharded the batch, so only the
SDPA dispatch is switched on here, through the private pair it calls
(``_context_parallel._attention._enable_context_parallel_dispatcher_impl``,
torch 2.13). This is the
one place that touches them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from ray_fsdp_backend.context_parallel.attention import causal_attention

ring_causal_attention = functools.partial(causal_attention, documents=False)
"""Plain causal SDPA on load-balanced shards: inside :func:`ring_region`
torch turns it into ring attention over the cp mesh (no mask: packing is
refused with ring)."""


@contextlib.contextmanager
def ring_region(cp_mesh) -> Iterator[None]:
    """Forward *and* backward of a micro-batch run inside this region: SDPA
    calls become load-balanced ring attention over ``cp_mesh`` (1-D)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_impl

    old = cp_impl._cp_options.enable_load_balance
    cp_impl._cp_options.enable_load_balance = True
    cp_impl._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=cp_mesh)
    try:
        yield
    finally:
        cp_impl._disable_context_parallel_dispatcher_impl()
        cp_impl._cp_options.enable_load_balance = old
