"""Exports and uploads that are whole or absent (2 gloo ranks, moto for S3).

One spawned job fine-tunes a tiny Llama under FSDP2 and runs every export
scenario in turn, recording each error message and how long it took:

- node-local target: each rank gets a directory of its own (a rank-dependent
  ``SubTreeFileSystem``): refused before any weight is written, naming the
  rank rank 0 cannot see and the remedy;
- weights on node-local disk: markers land in the shared directory but rank
  1's weight files go to a directory of its own: the export raises naming
  the missing files and the rank that wrote them, and writes no index;
- an old model directory (the pretrained checkpoint, one model.safetensors):
  refused without ``overwrite``; with ``overwrite=True`` the old weight file
  is gone and ``from_pretrained`` returns the fine-tuned model's logits;
- a write failure injected on rank 1: every rank raises naming rank 1's
  error within seconds (the process group's timeout is 120 s) and no
  temporary file is left.

Then, in this process: a writer that raises leaves no object on S3 and no
file locally, through ``open_whole``, a plain ``open_output_stream`` block
on the retrying filesystem, and DCP's writers.
"""

from __future__ import annotations

import os
import shutil
import time

import pyarrow.fs as pafs
import pytest
import torch

from ray_fsdp_backend import FSDPConfig, build_strategy
from ray_fsdp_backend.hf import export_model, load_pretrained
from ray_fsdp_backend.hf.models import build_causal_lm
from tests.dist.harness import run_ranks
from tests.hf_models import fine_tune, input_ids, save_tiny_pretrained

pytest.importorskip("transformers")


def _logits(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    model.eval()
    with torch.no_grad():
        out = model(input_ids()).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def _attempt(fn) -> tuple[str | None, float]:
    """``fn()``'s error message (None: it returned) and its seconds."""
    start = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return error, time.monotonic() - start


def _node_local_weights(rank, shared, node):
    """On rank 1, weight files go to ``node`` instead of ``shared`` (as on a
    disk of its own); markers and small files still land in ``shared``."""
    from ray_fsdp_backend.hf import writer

    real = writer.open_whole

    def redirected(fs, path):
        if rank == 1 and path.endswith(".safetensors"):
            os.makedirs(os.path.dirname(path.replace(shared, node)), exist_ok=True)
            path = path.replace(shared, node)
        return real(fs, path)

    writer.open_whole = redirected
    return lambda: setattr(writer, "open_whole", real)


def _fail_rank1_writes(rank):
    """Rank 1's local writes raise once some bytes are written."""
    from ray_fsdp_backend import retrying_fs

    real = retrying_fs._LocalWhole.write

    def failing(self, data):
        if rank == 1 and self.tell() > 0:
            raise OSError("injected write failure")
        return real(self, data)

    retrying_fs._LocalWhole.write = failing
    return lambda: setattr(retrying_fs._LocalWhole, "write", real)


def _scenarios(rank, world, src, base):
    config = FSDPConfig(use_fsdp=True, use_mixed_precision=False)
    strategy = build_strategy(config, device=torch.device("cpu"), local_rank=rank)
    model = strategy.wrap(build_causal_lm(src))
    load_pretrained(model, src)
    fine_tune(model, rank, world)
    trained = _logits(model)
    log = {}

    def export(path, **kwargs):
        return lambda: export_model(model, path, max_shard_size="20KB", **kwargs)

    node_fs = pafs.SubTreeFileSystem(f"{base}/node{rank}", pafs.LocalFileSystem())
    os.makedirs(f"{base}/node{rank}", exist_ok=True)
    log["node-local target"] = _attempt(export("export", filesystem=node_fs))
    restore = _node_local_weights(rank, f"{base}/shared", f"{base}/node{rank}")
    try:
        log["node-local weights"] = _attempt(export(f"{base}/shared/split"))
    finally:
        restore()
    log["old model, no overwrite"] = _attempt(export(f"{base}/old"))
    log["old model, overwrite"] = _attempt(export(f"{base}/old", overwrite=True))
    restore = _fail_rank1_writes(rank)
    try:
        log["write fails on rank 1"] = _attempt(export(f"{base}/shared/failing"))
    finally:
        restore()
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, log)
    return everyone, trained


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    src = save_tiny_pretrained("llama", tmp_path_factory.mktemp("src"), max_shard_size="1GB")
    base = tmp_path_factory.mktemp("export")
    shutil.copytree(src, base / "old")  # the model before fine-tuning: one model.safetensors
    os.makedirs(base / "shared")
    logs, trained = run_ranks(_scenarios, 2, src, str(base))
    return dict(src=src, base=base, logs=logs, trained=trained)


def _errors(run, scenario):
    return [log[scenario] for log in run["logs"]]


def _from_pretrained_logits(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids()).logits


def test_node_local_target_refused_naming_the_remedy(run):
    for rank, (error, _) in enumerate(_errors(run, "node-local target")):
        print(f"rank {rank}: {error}")
        assert error is not None and "not shared by every rank" in error, error
        assert "rank(s) 1 wrote" in error and "object-store URI" in error
    for node in ("node0", "node1"):  # refused before any weight was written
        files = os.listdir(run["base"] / node / "export")
        assert files == [], (node, files)


def test_missing_files_named_with_their_ranks_and_no_index(run):
    shared, node1 = run["base"] / "shared" / "split", run["base"] / "node1" / "split"
    moved = sorted(f for f in os.listdir(node1) if f.endswith(".safetensors"))
    assert moved, "rank 1 wrote no weight file"
    for error, _ in _errors(run, "node-local weights"):
        print(error)
        assert error is not None and "no index was written" in error, error
        for name in moved:
            assert f"{name} (rank 1: missing)" in error
    assert "model.safetensors.index.json" not in os.listdir(shared)


def test_old_model_refused_then_overwritten(run):
    old = run["base"] / "old"
    for error, _ in _errors(run, "old model, no overwrite"):
        assert error is not None and "not empty" in error and "overwrite=True" in error, error
    for error, _ in _errors(run, "old model, overwrite"):
        assert error is None, error
    names = set(os.listdir(old))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    got = _from_pretrained_logits(str(old))
    torch.testing.assert_close(got, run["trained"], atol=1e-5, rtol=1e-5)
    before = _from_pretrained_logits(run["src"])
    assert not torch.allclose(got, before, atol=1e-3)  # the fine-tuned weights, not the old


def test_write_failure_on_one_rank_fails_every_rank_promptly(run):
    for rank, (error, seconds) in enumerate(_errors(run, "write fails on rank 1")):
        print(f"rank {rank}: {seconds:.2f} s: {error}")
        assert error is not None and "rank 1: OSError: injected write failure" in error, error
        assert seconds < 10.0  # the process group's timeout is 120 s
    left = os.listdir(run["base"] / "shared" / "failing")
    assert not [f for f in left if f.endswith(".tmp")], left
    assert "model.safetensors.index.json" not in left


# -- a writer that raises leaves nothing -------------------------------------------------


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot be pickled")


def _raising_writes(fs, root):
    """Write through every path, raising in each block; returns what is left."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.api import CheckpointException

    from ray_fsdp_backend.checkpoint.store import CheckpointStore, dcp_writer
    from ray_fsdp_backend.retrying_fs import open_whole, with_retries

    fs = with_retries(fs)
    fs.create_dir(root, recursive=True)
    writes = [lambda: open_whole(fs, f"{root}/whole.bin")]
    if not isinstance(fs, pafs.LocalFileSystem):  # pyarrow's own local stream writes in place
        writes.append(lambda: fs.open_output_stream(f"{root}/plain.bin"))
    for write in writes:
        with pytest.raises(ValueError, match="boom"), write() as out:
            out.write(b"x" * 100_000)
            raise ValueError("boom")
    store = CheckpointStore(fs, root)
    state = {"a": "fine", "b": _Unpicklable(), "t": torch.ones(1000)}
    with pytest.raises(CheckpointException):  # "b" cannot be pickled, after "a" was written
        save(state, storage_writer=dcp_writer(store, "checkpoint_000001"), no_dist=True)
    selector = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    return sorted(i.path for i in fs.get_file_info(selector) if i.type == pafs.FileType.File)


def test_raising_writer_leaves_no_object_on_s3(s3_server):
    s3 = s3_server.filesystem()
    s3.create_dir("whole-or-absent")
    assert _raising_writes(s3, "whole-or-absent/run") == []


def test_raising_writer_leaves_no_local_file(tmp_path):
    assert _raising_writes(pafs.LocalFileSystem(), str(tmp_path / "run")) == []
