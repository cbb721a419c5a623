"""Re-initialising torch.distributed in one process: init, async save,
destroy, init again, async save. The async-save group belongs to the
``AsyncCheckpointer``, which makes a new one under the new default group
(a group kept in a module global outlived its world: ``ValueError: Process
group ... is not initialized in the world group map``). Both checkpoints
load into fresh models and equal single-process training on the same data."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ray_fsdp_backend.checkpoint import AsyncCheckpointer, CheckpointStore, load_sharded
from tests.dist.harness import free_port, run_ranks
from tests.dist.test_checkpoint import FSDP, _full_state, _step, _wrap
from tests.models import reference_model


def _save_reinit_save(rank, world_size, root, port):
    store = CheckpointStore.local(root)
    saver = AsyncCheckpointer()
    model, opt = _wrap(FSDP, rank)
    for _ in range(2):
        _step(model, opt, rank, world_size)
    pending = saver.start(store, model, opt, extra_state={"step": 2})
    _step(model, opt, rank, world_size)  # training moves on during the write
    first = pending.wait()

    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))  # fmt: skip
    torch.manual_seed(123)  # another init: the load must overwrite it
    model, opt = _wrap(FSDP, rank)
    load_sharded(store, first, model, opt)
    loaded_first = _full_state(model, opt)
    _step(model, opt, rank, world_size)
    second = saver.start(store, model, opt, extra_state={"step": 3}).wait()
    torch.manual_seed(7)
    model, opt = _wrap(FSDP, rank)
    extra = load_sharded(store, second, model, opt)
    saver.close()
    return first, second, extra, loaded_first, _full_state(model, opt)


def _reference_state(steps: int) -> dict[str, torch.Tensor]:
    """``_full_state`` of one process training on the whole batch."""
    model = reference_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for _ in range(steps):
        _step(model, opt, 0, 1)
    out = {f"param/{k}": v for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out.update({f"optim/{name}/{k}": torch.as_tensor(v) for k, v in opt.state[p].items()})
    return out


def test_async_save_after_destroy_and_init_again(tmp_path):
    first, second, extra, loaded_first, loaded_second = run_ranks(
        _save_reinit_save, 2, str(tmp_path), free_port()
    )
    assert (first, second) == ("checkpoint_000001", "checkpoint_000002")
    assert (tmp_path / second / "COMPLETE").exists() and extra == {"step": 3}
    for got, steps in ((loaded_first, 2), (loaded_second, 3)):
        want = _reference_state(steps)
        assert got.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)
