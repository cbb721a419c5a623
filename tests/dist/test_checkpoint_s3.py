"""Sharded checkpoints straight on a real S3 API (moto server) from gloo
ranks, no Ray: each rank reads only its byte ranges (bytes counted), restores
reshard 4 -> 2 ranks exactly, and an asynchronous save writes the state as it
was when staged, or, when its background write fails, leaves the previous
checkpoint the newest complete one with an error that names the store;
DMuon's state reshards 4 -> 2 ranks from S3 too. One spawned job per world
size (4, then 2) runs every case of the module."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ray_fsdp_backend.checkpoint import (
    CheckpointStore,
    find_latest,
    load_sharded,
    save_sharded,
    sharded,
)
from ray_fsdp_backend.checkpoint import store as store_mod
from ray_fsdp_backend.checkpoint.sharded import AsyncCheckpointer, CheckpointStorageError
from tests import counting_fs
from tests.dist.test_checkpoint import FSDP, _assert_states_equal, _full_state, _step, _wrap
from tests.dist.test_dmuon import (  # noqa: F401  (reference is a fixture)
    CKPT_AFTER,
    STEPS,
    assert_params_close,
    reference,
    runtime,
    train,
)
from tests.dist.test_dmuon import build as dmuon_build

MODEL = {"dim": 256, "n_layers": 4}  # ~3 MiB with Adam moments: metadata stays small
ROOT, DMUON_ROOT = "dist-ckpt/run", "dist-dmuon/run"


def _total_read(fn) -> int:
    """Bytes all ranks read from the store while ``fn()`` ran."""
    before = counting_fs.BYTES_READ[0]
    fn()
    mine = [counting_fs.BYTES_READ[0] - before]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sum(x[0] for x in everyone)


def _save_restore_four(rank, world_size, s3, root):
    store = CheckpointStore(counting_fs.counting(s3), root)
    model, opt = _wrap(FSDP, rank, **MODEL)
    _step(model, opt, rank, world_size)
    name = save_sharded(store, model, opt, extra_state={"step": 1})
    saved = _full_state(model, opt)
    torch.manual_seed(5)
    fresh, fresh_opt = _wrap(FSDP, rank, **MODEL)
    read = _total_read(lambda: load_sharded(store, name, fresh, fresh_opt))
    _assert_states_equal(_full_state(fresh, fresh_opt), saved)
    # Async: state staged at save time, training moves on before the write ends.
    _step(model, opt, rank, world_size)
    staged = _full_state(model, opt)
    saver = AsyncCheckpointer()
    pending = saver.start(store, model, opt, extra_state={"step": 2})
    _step(model, opt, rank, world_size)
    async_name = pending.wait()
    # A background write that fails: no marker, an error naming the store.
    writer = store_mod.dcp_writer
    sharded.dcp_writer = lambda *a: _failing(writer(*a), rank)
    pending = saver.start(store, model, opt, extra_state={"step": 3})
    try:
        pending.wait()
        error = None
    except CheckpointStorageError as exc:
        error = str(exc)
    sharded.dcp_writer = writer
    saver.close()
    latest = find_latest(CheckpointStore(s3, root))
    return read, saved, staged, async_name, error, latest


def _failing(writer, rank):
    if rank == 1:
        original = writer.write_data

        def write_data(plan, planner):
            raise OSError("injected failure in the background write")

        writer.write_data = write_data
        del original
    return writer


def _restore_two(rank, world_size, s3, root, name):
    store = CheckpointStore(counting_fs.counting(s3), root)
    torch.manual_seed(9)
    model, opt = _wrap(FSDP, rank, **MODEL)
    read = _total_read(lambda: load_sharded(store, name, model, opt))
    return read, _full_state(model, opt)


def _four_ranks(rank, world_size, s3):
    return (
        _save_restore_four(rank, world_size, s3, ROOT),
        _dmuon_save(rank, world_size, s3, DMUON_ROOT),
    )


def _two_ranks(rank, world_size, s3, dmuon_name):
    return (
        _restore_two(rank, world_size, s3, ROOT, "checkpoint_000001"),
        _restore_two(rank, world_size, s3, ROOT, "checkpoint_000002"),
        _dmuon_resume(rank, world_size, s3, DMUON_ROOT, dmuon_name),
    )


@pytest.fixture(scope="module")
def spawned(s3_server):
    """The store, and what the 4-rank and then the 2-rank job returned."""
    from tests.dist.harness import run_ranks

    s3 = s3_server.filesystem()
    for root in (ROOT, DMUON_ROOT):
        s3.create_dir(root.split("/")[0])
    four = run_ranks(_four_ranks, 4, s3)
    return s3, four, run_ranks(_two_ranks, 2, s3, four[1])


def test_ranged_restore_reshard_and_async_save_on_s3(spawned):
    s3, ((read4, saved, staged, async_name, error, latest), _), two = spawned
    root = ROOT
    size = counting_fs.tree_size(s3, f"{root}/checkpoint_000001")
    print(f"checkpoint {size} B; restore at 4 ranks read {read4} B ({read4 / size:.2f}x)")
    assert read4 <= 1.2 * size, (read4, size)
    assert async_name == "checkpoint_000002"
    assert error is not None and "s3://dist-ckpt/run" in error and "injected" in error, error
    assert "testing" not in error  # no credentials in messages
    assert latest == "checkpoint_000002"  # the failed async save never committed
    (read2, loaded), (_, async_loaded), _ = two
    print(f"restore at 2 ranks read {read2} B ({read2 / size:.2f}x)")
    assert read2 <= 1.2 * size, (read2, size)
    _assert_states_equal(loaded, saved)
    _assert_states_equal(async_loaded, staged)


def _dmuon_save(rank, world_size, s3, root):
    strategy, model, opt = dmuon_build(world_size, hybrid=False)
    no_sync, clip = runtime(strategy)
    steps = range(CKPT_AFTER)
    train(model, opt, steps, no_sync=no_sync, clip=clip, rank=rank, world_size=world_size)
    return save_sharded(CheckpointStore(s3, root), model, opt, strategy="dmuon")


def _dmuon_resume(rank, world_size, s3, root, name):
    strategy, model, opt = dmuon_build(world_size, hybrid=False)
    store = CheckpointStore(counting_fs.counting(s3), root)
    read = _total_read(lambda: load_sharded(store, name, model, opt))
    no_sync, clip = runtime(strategy)
    steps = range(CKPT_AFTER, STEPS)
    train(model, opt, steps, no_sync=no_sync, clip=clip, rank=rank, world_size=world_size)
    return read, {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def test_dmuon_state_reshards_4_to_2_ranks_from_s3(spawned, reference):  # noqa: F811
    """DMuon's momentum (sharded like its matrices) and the AdamW moments,
    saved by 4 ranks on S3 and restored by 2 with ranged reads, end where
    one process running torch's Muon and AdamW ends."""
    s3, (_, name), (_, _, (read, params)) = spawned
    size = counting_fs.tree_size(s3, f"{DMUON_ROOT}/{name}")
    print(f"DMuon checkpoint {size} B; restore at 2 ranks read {read} B ({read / size:.2f}x)")
    assert read <= 1.2 * size, (read, size)
    assert_params_close(params, reference[0], "DMuon saved at 4 ranks on S3, finished at 2")
