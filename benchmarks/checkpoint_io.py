"""Comparison 7: checkpoint I/O on local disk and on an S3 API (moto on loopback).

For one FSDP2 model with AdamW state, at each world size:

- **save**: ``save_sharded`` (every rank writes its files straight to the store);
- **restore**: ``load_sharded`` with ranged reads (ours) vs **before**: every
  rank downloads the whole checkpoint directory and reads it locally (what
  ``checkpoint/store.py`` did on object storage up to this change;
  reproduced here to compare; a local store was and is read in place);
  bytes read by all ranks together, counted by ``tests.counting_fs``;
- **stall**: training time lost to one checkpoint, ``steps`` training steps
  with a checkpoint at the first minus the same steps without; synchronous
  ``save_sharded`` vs ``AsyncCheckpointer.start`` (its write overlaps the steps;
  the wait for it at the end is counted);
- **staged**: how long ``AsyncCheckpointer.start`` blocks the step that saves
  (copying the state to host memory): the stall where the background write
  has a core of its own (GPU training leaves the host's cores idle).

Times are the slowest rank's medians over ``reps`` alternating repetitions.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ray_fsdp_backend as rfb
from benchmarks import _measure, _workload
from ray_fsdp_backend.checkpoint import sharded
from ray_fsdp_backend.checkpoint.store import CheckpointStore
from tests import counting_fs


def _setup(model_cfg: dict, rank: int):
    strategy = rfb.build_strategy(
        {"use_fsdp": True, "use_mixed_precision": False},
        device=torch.device("cpu"),
        local_rank=rank,
    )
    model = strategy.wrap(_workload.build_model(model_cfg))
    opt = _workload.make_optimizer(model)
    batches = _workload.make_batches(model_cfg, 4, 1, rank)

    def step():
        opt.zero_grad()
        _workload.loss_fn(model, *batches[0]).backward()
        opt.step()

    step()
    return model, opt, step


def _read_all(fn) -> int:
    before = counting_fs.BYTES_READ[0]
    fn()
    mine = torch.tensor([counting_fs.BYTES_READ[0] - before], dtype=torch.int64)
    dist.all_reduce(mine)
    return int(mine)


def _restore_before(store: CheckpointStore, name: str, model, opt) -> None:
    """The previous restore: download the whole checkpoint, read it locally."""
    local = tempfile.mkdtemp(prefix="rfb_bench_")
    try:
        pafs.copy_files(store.path(name), local, source_filesystem=store.fs,
                        destination_filesystem=pafs.LocalFileSystem())  # fmt: skip
        state = sharded._state_to_load(model, opt, flat=False)
        dcp.load(state, storage_reader=dcp.FileSystemReader(local))
        sharded._set_state(model, opt, state, flat=False)  # not a pipeline stage
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _timed(fn) -> float:
    _measure.barrier()
    start = time.perf_counter()
    fn()
    _measure.barrier()
    return time.perf_counter() - start


def _one_store(store: CheckpointStore, model, opt, step, *, reps: int, steps: int) -> dict:
    keys = ("save", "restore", "restore_before", "plain", "sync", "async", "staged")
    times = {k: [] for k in keys}
    staged = times["staged"]  # appended to by the async runs
    reads = {}
    saver = sharded.AsyncCheckpointer()
    for rep in range(reps):
        name = _save_restore(store, model, opt, rep, times, reads)
        times["plain"].append(_timed(lambda: [step() for _ in range(steps)]))
        times["sync"].append(_timed(lambda: _steps_with(store, model, opt, step, steps, None)))
        times["async"].append(
            _timed(lambda: staged.append(_steps_with(store, model, opt, step, steps, saver)))
        )
    saver.close()
    med = {k: statistics.median(_measure.max_over_ranks(v)) for k, v in times.items()}
    size = counting_fs.tree_size(store.fs, store.path(name))
    return {
        "size": size,
        "save_s": med["save"],
        "restore_s": med["restore"],
        "restore_before_s": med["restore_before"],
        "read": reads["restore"],
        "read_before": reads["restore_before"],
        "stall_sync_s": med["sync"] - med["plain"],
        "stall_async_s": med["async"] - med["plain"],
        "staged_s": med["staged"],
        "step_s": med["plain"] / steps,
    }


def _save_restore(store, model, opt, rep: int, times: dict, reads: dict) -> str:
    """One save, then both restores of it (order alternating); returns its name."""
    start = time.perf_counter()
    name = sharded.save_sharded(store, model, opt, extra_state={"step": rep})
    times["save"].append(time.perf_counter() - start)
    order = {
        "restore": lambda: sharded.load_sharded(store, name, model, opt),
        "restore_before": lambda: _restore_before(store, name, model, opt),
    }
    for key in list(order) if rep % 2 == 0 else list(order)[::-1]:
        reads[key] = _read_all(lambda key=key: times[key].append(_timed(order[key])))
    return name


def _steps_with(store, model, opt, step, steps: int, saver) -> float:
    """``steps`` steps with a save after the first, in the background when
    ``saver`` (an ``AsyncCheckpointer``) is given; returns how long the save
    blocked this rank (for an async save: until the state was staged)."""
    step()
    start = time.perf_counter()
    if saver is not None:
        pending = saver.start(store, model, opt, extra_state={"step": 0})
    else:
        sharded.save_sharded(store, model, opt, extra_state={"step": 0})
    blocked = time.perf_counter() - start
    for _ in range(steps - 1):
        step()
    if saver is not None:
        pending.wait()
    return blocked


def on_rank(rank: int, world: int, *, model: dict, local_root: str, s3_endpoint: str,
            reps: int, steps: int) -> dict:  # fmt: skip
    torch.set_num_threads(1)
    model_, opt, step = _setup(model, rank)
    from tests.conftest import S3Server

    port = int(s3_endpoint.rsplit(":", 1)[1])
    stores = {
        "local disk": CheckpointStore(pafs.LocalFileSystem(), local_root),
        "S3 (moto, loopback)": CheckpointStore(
            counting_fs.counting(S3Server(port).filesystem()), f"bench-ckpt/w{world}"
        ),
    }
    out = {"world_size": world, "stores": {}}
    for label, store in stores.items():
        out["stores"][label] = _one_store(store, model_, opt, step, reps=reps, steps=steps)
    return out


def _entry(rank: int, world: int, kwargs: dict) -> dict:
    return on_rank(rank, world, **kwargs)


def run(*, worlds, model: dict, reps: int, steps: int, run_ranks=None) -> list[dict]:
    """Start a moto S3 server in this process and measure at each world size;
    ``run_ranks``: the gloo harness's (the default) or a rank pool's."""
    from tests.conftest import moto_server

    if run_ranks is None:
        from tests.dist.harness import run_ranks

    with moto_server() as server:
        server.filesystem().create_dir("bench-ckpt")
        results = []
        for world in worlds:
            with tempfile.TemporaryDirectory() as local_root:
                kwargs = dict(model=model, local_root=local_root,
                              s3_endpoint=server.endpoint, reps=reps, steps=steps)  # fmt: skip
                results.append(run_ranks(_entry, world, kwargs))
        return results
