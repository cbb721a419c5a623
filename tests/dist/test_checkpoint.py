"""Sharded checkpoints on gloo ranks without Ray: resharding across world size
and strategy, crash during save, mismatched models, RNG/extra state, export
(checked in a fresh process without this package), rank-local buffers.

Three spawned jobs for the module (:func:`spawned`): 4 ranks save, 2 ranks
save and crash, then one 2-rank job reshards the 4-rank checkpoint, resumes
after the crash and round-trips rank-local buffers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import ray_fsdp_backend as rfb
from ray_fsdp_backend.checkpoint import (
    CheckpointMismatchError,
    CheckpointStore,
    find_latest,
    load_sharded,
    save_sharded,
    sharded,
)
from ray_fsdp_backend.hf import export_model
from tests.dist.harness import run_ranks
from tests.models import make_batch, reference_model

FSDP = {"use_fsdp": True, "use_mixed_precision": False}
HSDP = {**FSDP, "fsdp_sharding_strategy": "hybrid_shard"}
DDP = {"use_fsdp": False, "use_mixed_precision": False}


def _wrap(config: dict, rank: int, **model_kwargs):
    strategy = rfb.build_strategy(config, device=torch.device("cpu"), local_rank=rank)
    model = strategy.wrap(reference_model(**model_kwargs))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _step(model, opt, rank: int, world_size: int) -> float:
    """One AdamW step on this rank's slice of the fixed batch (16 samples)."""
    x, y = make_batch(16)
    per = 16 // world_size
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    """Parameters and optimizer moments as full tensors, keyed by FQN."""
    options = StateDictOptions(full_state_dict=True)
    out = {f"param/{k}": v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, opt, options=options)
    for fqn, state in optim["state"].items():
        out.update({f"optim/{fqn}/{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _assert_states_equal(got: dict, want: dict, atol: float = 0.0) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=key)


# -- resharding -----------------------------------------------------------


def _save_four_ranks(rank, world_size, root):
    model, opt = _wrap(FSDP, rank)
    for _ in range(3):
        _step(model, opt, rank, world_size)
    # A store that is not a LocalFileSystem: ranks write and read through fsspec, as on a bucket.
    import pyarrow.fs as pafs

    store = CheckpointStore(pafs.SubTreeFileSystem(root, pafs.LocalFileSystem()), "run")
    save_sharded(store, model, opt, extra_state={"step": 3}, strategy="FSDPStrategy")
    saved = _full_state(model, opt)
    _step(model, opt, rank, world_size)
    return saved, _full_state(model, opt)


def _load_two_ranks(rank, world_size, root):
    out = {}
    for label, config in [("fsdp", FSDP), ("hsdp", HSDP), ("ddp", DDP)]:
        # hybrid_shard: one rank per "node", so the mesh is 2 (replicate) x 1 (shard).
        os.environ["LOCAL_WORLD_SIZE"] = "1" if label == "hsdp" else str(world_size)
        torch.manual_seed(123)  # a different init: the load must overwrite it
        model, opt = _wrap(config, rank)
        store = CheckpointStore.local(os.path.join(root, "run"))
        extra = load_sharded(store, find_latest(store), model, opt)
        loaded = _full_state(model, opt)
        _step(model, opt, rank, world_size)
        out[label] = (extra, loaded, _full_state(model, opt))
    return out


def _two_ranks(rank, world, reshard_root, crash_root, buffers_root):
    return (
        _load_two_ranks(rank, world, reshard_root),
        _restore_after_crash(rank, world, crash_root),
        _per_rank_buffers(rank, world, buffers_root),
    )


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The three roots, what the 4-rank save returned, whether the crash left
    a partial checkpoint (its files before the next job), and what the 2-rank
    job returned."""
    roots = [tmp_path_factory.mktemp(name) for name in ("reshard", "crash", "buffers")]
    four = run_ranks(_save_four_ranks, 4, str(roots[0]))
    with pytest.raises(AssertionError, match="a rank failed"):
        run_ranks(_save_then_crash, 2, str(roots[1]))
    partial = sorted(os.listdir(roots[1] / "checkpoint_000002"))
    return roots, four, partial, run_ranks(_two_ranks, 2, *map(str, roots))


def test_reshard_four_fsdp_ranks_to_two_fsdp_hsdp_ddp(spawned):
    (root, _, _), (saved, after_next_step), _, (loaded_all, _, _) = spawned
    assert (root / "run" / "checkpoint_000001" / "COMPLETE").exists()
    for label, (extra, loaded, stepped) in loaded_all.items():
        assert extra == {"step": 3}, label
        # Parameters and Adam moments are copied exactly, DDP keys without `module.`.
        _assert_states_equal(loaded, saved)
        # The moments are live: the next step matches the 4-rank run's next step.
        _assert_states_equal(stepped, after_next_step, atol=1e-6)


# -- crash during save, restore, mismatch ----------------------------------


def _save_then_crash(rank, world_size, root):
    model, opt = _wrap(FSDP, rank)
    store = CheckpointStore.local(root)
    torch.manual_seed(100 + rank)  # each rank's generator at its own position
    torch.rand(rank + 1)
    _step(model, opt, rank, world_size)
    save_sharded(store, model, opt, extra_state={"step": 1, "data": [rank, 7]})
    after_save = {"rand": torch.rand(4), "params": _full_state(model, opt)}
    torch.save(after_save, os.path.join(root, f"after_save_{rank}.pt"))
    _step(model, opt, rank, world_size)
    if rank == 0:
        # Dies after DCP wrote every shard and .metadata, before the marker.
        sharded.commit_checkpoint = lambda *args: os._exit(1)
    save_sharded(store, model, opt, extra_state={"step": 2})


def _restore_after_crash(rank, world_size, root):
    store = CheckpointStore.local(root)
    model, opt = _wrap(FSDP, rank)
    torch.manual_seed(999)  # the load must put the saved generator state back
    name = find_latest(store)
    extra = load_sharded(store, name, model, opt)
    state = {"rand": torch.rand(4), "params": _full_state(model, opt)}
    errors = []
    for kwargs in ({"n_layers": 3}, {"dim": 12}):
        other, other_opt = _wrap(FSDP, rank, **kwargs)
        with pytest.raises(CheckpointMismatchError) as info:
            load_sharded(store, name, other, other_opt)
        errors.append(str(info.value))
    next_name = save_sharded(store, model, opt, extra_state={"step": 3})
    listing = sorted(os.listdir(root))
    return name, extra, state, errors, next_name, listing, _export(rank, root)


def test_crash_during_save_resumes_previous_and_mismatch_names_keys(spawned):
    (_, tmp_path, _), _, partial, (_, restored, _) = spawned
    assert ".metadata" in partial and "COMPLETE" not in partial

    name, extra, state, errors, next_name, listing, exported = restored
    assert name == "checkpoint_000001"
    assert extra == {"step": 1, "data": [0, 7]}  # rank 0's own extra state
    want = torch.load(tmp_path / "after_save_0.pt")
    _assert_states_equal(state["params"], want["params"])
    # The RNG continues exactly where it was when the checkpoint was written.
    torch.testing.assert_close(state["rand"], want["rand"], atol=0, rtol=0)
    assert not torch.equal(want["rand"], torch.load(tmp_path / "after_save_1.pt")["rand"])
    missing, shape = errors
    assert "missing in checkpoint: model.layers.2.fc.bias" in missing
    assert "optim.state.layers.2.fc.weight.exp_avg" in missing
    assert "shape mismatch: model.head.weight (model [8, 12], checkpoint [8, 16])" in shape
    # The next save goes after the partial one, and the partial one is deleted.
    assert next_name == "checkpoint_000003"
    assert "checkpoint_000002" not in listing and "checkpoint_000001" in listing
    _check_export_in_fresh_process(tmp_path, *exported)


def test_extra_state_that_needs_pickle_is_refused_before_writing():
    with pytest.raises(ValueError, match="weights_only"):
        sharded.encode_extra_state({"schedule": object()})


# -- export -----------------------------------------------------------------


def _export(rank, root):
    """Export a trained FSDP model with tied input/output weights; return the
    file and the wrapped model's outputs on a probe batch."""
    model, opt = _wrap(FSDP, rank, dim_in=16, dim=16, dim_out=16, tied=True)
    x, y = make_batch(8, dim_in=16, dim_out=16, seed=rank + 2)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    path = export_model(model, os.path.join(root, "export", "model.safetensors"))
    probe = make_batch(4, dim_in=16, dim_out=16, seed=5)[0]
    with torch.no_grad():
        return path, model(probe)


_LOAD_PLAIN = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import load_file
    from tests.models import ToyNet, make_batch
    model = ToyNet(dim_in=16, dim=16, dim_out=16, tied=True)
    model.load_state_dict(load_file(sys.argv[1]), strict=True)
    assert not any(m.startswith("ray_fsdp_backend") for m in sys.modules), "package imported"
    x = make_batch(4, dim_in=16, dim_out=16, seed=5)[0]
    with torch.no_grad():
        torch.save(model(x), sys.argv[2])
    """
)


def _check_export_in_fresh_process(tmp_path, path, wrapped_out):
    """The export loads into a plain ToyNet in a process that never imports
    this package, and gives the wrapped model's outputs."""
    out_file = str(tmp_path / "plain_out.pt")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run(
        [sys.executable, "-c", _LOAD_PLAIN, path, out_file], check=True, cwd=root, timeout=120
    )
    torch.testing.assert_close(torch.load(out_file), wrapped_out, atol=1e-6, rtol=0)


class _RunningMean(torch.nn.Module):
    """A linear layer with a rank-local running statistic (a persistent buffer)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.register_buffer("running", torch.zeros(4))

    def forward(self, x):
        self.running.mul_(0.5).add_(x.mean(0).detach())
        return self.fc(x)


def _per_rank_buffers(rank: int, world_size: int, path: str) -> list[list[float]]:
    store = CheckpointStore.local(path)
    strategy = rfb.build_strategy(FSDP, device=torch.device("cpu"), local_rank=rank)
    torch.manual_seed(0)
    model = strategy.wrap(_RunningMean())  # FSDP2 never syncs buffers
    model(torch.full((2, 4), float(rank + 1)))  # each rank sees its own data
    saved = model.running.clone()
    save_sharded(store, model, None)
    model.running.fill_(-7.0)
    load_sharded(store, find_latest(store), model, None)
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, [saved.tolist(), model.running.tolist()])
    return everyone


def test_rank_local_buffers_come_back_per_rank(spawned):
    *_, (_, _, results) = spawned
    assert results[0][0] != results[1][0]  # the ranks really differ
    for saved, restored in results:
        assert restored == saved
