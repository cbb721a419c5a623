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
  error within seconds (the process group's timeout is 60 s) and no
  temporary file is left; so does an error in a gather on rank 1 (as an
  out-of-memory there), and, in a PEFT export, a failed write on rank 0 or
  a failed gather on rank 1;
- overwrites interrupted between phases (every rank raising after the new
  shards are written, or at the index): the previous export still loads
  with ``from_pretrained``; the next complete overwrite loads the new
  weights and leaves none of the old files.

Then, in this process: a writer that raises leaves no object on S3 and no
file locally, through ``open_whole``, a plain ``open_output_stream`` block
on the retrying filesystem, and DCP's writers.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pyarrow.fs as pafs
import pytest
import torch

from ray_fsdp_backend import FSDPConfig, build_strategy
from ray_fsdp_backend.hf import export as export_module
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
    from ray_fsdp_backend.storage.whole_file import LocalWholeFile

    real = LocalWholeFile.write

    def failing(self, data):
        if rank == 1 and self.tell() > 0:
            raise OSError("injected write failure")
        return real(self, data)

    LocalWholeFile.write = failing
    return lambda: setattr(LocalWholeFile, "write", real)


def _patched(module, name, replacement):
    """``module.name`` replaced by ``replacement(real)``; returns the undo."""
    real = getattr(module, name)
    setattr(module, name, replacement(real))
    return lambda: setattr(module, name, real)


def _failing_on(rank, failing_rank, call, error, *, before=False):
    """A wrapper of ``real`` that, on ``failing_rank``, raises ``error`` at
    its ``call``-th call: after the call has run (a failure inside a
    gather, once this rank took part in its collective), or ``before``."""

    def wrap(real):
        calls = [0]

        def wrapper(*args, **kwargs):
            calls[0] += 1
            failing = rank == failing_rank and calls[0] == call
            if failing and before:
                raise error
            out = real(*args, **kwargs)
            if failing:
                raise error
            return out

        return wrapper

    return wrap


def _interrupted(exc_text):
    """A replacement that raises on every rank (a job killed between phases)."""
    return lambda real: lambda *a, **k: (_ for _ in ()).throw(RuntimeError(exc_text))


def _with(undo, fn):
    try:
        return _attempt(fn)
    finally:
        undo()


def _non_write_failures(rank, export, base):
    from ray_fsdp_backend.hf import writer

    oom = RuntimeError("injected out of memory in a gather")
    return {
        "gather fails on rank 1": _with(
            _patched(writer, "full_tensor", _failing_on(rank, 1, 3, oom)),
            export(f"{base}/shared/gather"),
        )
    }


def _overwrites(rank, world, model, export, base):
    """Interrupted, then complete, overwrites; rank 0 snapshots the target
    after each interruption."""
    log = {}
    log["cut after the shards"] = _with(
        _patched(export_module, "verify_files", _interrupted("interrupted after the shards")),
        export(f"{base}/cut1", overwrite=True),
    )
    log["fresh export"] = _attempt(export(f"{base}/cut2"))
    fine_tune(model, rank, world, steps=1)
    retrained = _logits(model)
    log["cut at the index"] = _with(
        _patched(export_module, "_index", _interrupted("interrupted at the index")),
        export(f"{base}/cut2", overwrite=True),
    )
    if rank == 0:
        shutil.copytree(f"{base}/cut2", f"{base}/cut2-after-cut")
    log["complete overwrite"] = _attempt(export(f"{base}/cut2", overwrite=True))
    return log, retrained


def _peft_failures(rank, world, src, base):
    from ray_fsdp_backend.hf import peft_export
    from tests.dist.test_lora import _wrap as wrap_lora

    _, model = wrap_lora("full_shard", rank, world, src)

    def export(path):
        return lambda: export_model(model, path, format="peft")

    denied = OSError("injected adapter write failure")
    oom = RuntimeError("injected out of memory in an adapter gather")
    return {
        "peft write fails on rank 0": _with(
            _patched(peft_export, "write_bytes", _failing_on(rank, 0, 1, denied, before=True)),
            export(f"{base}/shared/peft-write"),
        ),
        "peft gather fails on rank 1": _with(
            _patched(peft_export, "full_tensor", _failing_on(rank, 1, 2, oom)),
            export(f"{base}/shared/peft-gather"),
        ),
        "peft export": _attempt(export(f"{base}/shared/peft")),
    }


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
    log.update(_non_write_failures(rank, export, base))
    log.update(_peft_failures(rank, world, src, base))
    overwrites, retrained = _overwrites(rank, world, model, export, base)
    log.update(overwrites)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, log)
    return everyone, trained, retrained


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    src = save_tiny_pretrained("llama", tmp_path_factory.mktemp("src"), max_shard_size="1GB")
    base = tmp_path_factory.mktemp("export")
    shutil.copytree(src, base / "old")  # the model before fine-tuning: one model.safetensors
    shutil.copytree(src, base / "cut1")
    os.makedirs(base / "shared")
    logs, trained, retrained = run_ranks(_scenarios, 2, src, str(base), timeout_s=60)
    return dict(src=src, base=base, logs=logs, trained=trained, retrained=retrained)


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


@pytest.mark.parametrize(
    "scenario, target, cause",
    [
        ("write fails on rank 1", "failing", "rank 1: OSError: injected write failure"),
        ("gather fails on rank 1", "gather", "rank 1: RuntimeError: injected out of memory"),
        ("peft write fails on rank 0", "peft-write", "rank 0: OSError: injected adapter write"),
        ("peft gather fails on rank 1", "peft-gather", "rank 1: RuntimeError: injected out of"),
    ],
)
def test_failure_on_one_rank_fails_every_rank_promptly(run, scenario, target, cause):
    for rank, (error, seconds) in enumerate(_errors(run, scenario)):
        print(f"rank {rank}: {seconds:.2f} s: {error}")
        assert error is not None and cause in error, error
        assert "RankFailedError" in error and target in error, error
        assert seconds < 10.0  # the process group's timeout is 60 s
    where = run["base"] / "shared" / target
    left = os.listdir(where) if where.exists() else []
    assert not [f for f in left if f.endswith(".tmp")], left
    assert "model.safetensors.index.json" not in left


def test_the_process_group_survives_failed_exports(run):
    for error, _ in _errors(run, "peft export") + _errors(run, "complete overwrite"):
        assert error is None, error
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(
        os.listdir(run["base"] / "shared" / "peft")
    )


def test_interrupted_overwrite_leaves_the_previous_export_loadable(run):
    base = run["base"]
    for scenario, cause in [
        ("cut after the shards", "interrupted after the shards"),
        ("cut at the index", "interrupted at the index"),
    ]:
        for error, _ in _errors(run, scenario):
            assert error is not None and cause in error, error
    # The pretrained single file beside the new shards: still the old model.
    names = os.listdir(base / "cut1")
    assert "model.safetensors" in names and [n for n in names if n.startswith("model-")]
    before = _from_pretrained_logits(run["src"])
    torch.testing.assert_close(_from_pretrained_logits(str(base / "cut1")), before)
    # An export of ours, cut at its index: its old index still names its old shards.
    cut = base / "cut2-after-cut"
    assert len([n for n in os.listdir(cut) if n.endswith(".safetensors")]) > 1
    got = _from_pretrained_logits(str(cut))
    torch.testing.assert_close(got, run["trained"], atol=1e-5, rtol=1e-5)
    # The complete overwrite: the new weights, and none of the old files.
    got = _from_pretrained_logits(str(base / "cut2"))
    torch.testing.assert_close(got, run["retrained"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, run["trained"], atol=1e-4)
    index = json.loads((base / "cut2" / "model.safetensors.index.json").read_text())
    shards = {n for n in os.listdir(base / "cut2") if n.endswith(".safetensors")}
    assert shards == set(index["weight_map"].values()), shards


# -- a writer that raises leaves nothing -------------------------------------------------


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot be pickled")


def _raising_writes(fs, root):
    """Write through every path, raising in each block; returns what is left."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.api import CheckpointException

    from ray_fsdp_backend.checkpoint.store import CheckpointStore, dcp_writer
    from ray_fsdp_backend.storage.retrying_fs import open_whole, with_retries

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
