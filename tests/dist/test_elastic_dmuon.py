"""An elastic run grows as well as shrinks: DMuon's sharded momentum and the
AdamW moments saved by 2 gloo ranks are resharded onto 4 (DMuon re-plans
which rank orthogonalises each matrix), and the run ends where one process
running torch's own Muon and AdamW ends. (4 -> 2 is tested in test_dmuon.py.)"""

from __future__ import annotations

from ray_fsdp_backend.checkpoint import CheckpointStore, save_sharded
from tests.dist.harness import run_ranks
from tests.dist.test_dmuon import (  # noqa: F401  (reference is a fixture)
    CKPT_AFTER,
    assert_params_close,
    build,
    reference,
    resume,
    runtime,
    train,
)


def save_at_two_ranks(rank, world_size, ckpt_dir) -> None:
    strategy, model, opt = build(world_size, hybrid=False)
    no_sync, clip = runtime(strategy)
    train(
        model, opt, range(CKPT_AFTER), no_sync=no_sync, clip=clip, rank=rank, world_size=world_size
    )
    save_sharded(CheckpointStore.local(ckpt_dir), model, opt, strategy="dmuon")


def test_dmuon_checkpoint_at_2_ranks_resumes_at_4(tmp_path, reference):  # noqa: F811
    run_ranks(save_at_two_ranks, 2, str(tmp_path))
    grown = run_ranks(resume, 4, str(tmp_path))
    assert_params_close(grown, reference[0], "saved at 2 ranks, finished at 4")
