"""Comparison 10: Hugging Face checkpoints on object storage with latency.

A random Llama in bf16 safetensors shards sits on a moto S3 server on
loopback, reached through :class:`DelayProxy`, which holds back the first
byte of every response by ``latency_s`` (30 ms: a cloud store's first-byte
latency). At each world size, FSDP2 full_shard ranks build the model on the
meta device and ``load_pretrained`` it from ``s3://``:

- **before**: the package as it was before issue 23 (``baseline`` commit,
  checked out into a temporary worktree): every rank reads every header,
  then one ``read_at`` per slice, one after another.
- **after**: this tree: headers read by rank 0 and broadcast, a rank's
  slices fetched concurrently.

Time is the slowest rank's ``load_pretrained`` (the model already built and
wrapped); requests and bytes are what the proxy carried (all ranks, HTTP
included), and the largest ``bytes_read`` of one rank. moto serves about
20 MB/s on 2 shared cores, so the checkpoint is many small tensors (147
tensors, 7 MiB), where per-request latency dominates as it does for an 8B
model's 291 tensors on a real store. Then (after only) the loaded
model is exported to ``s3://`` in HF layout: time, and the bytes each rank
uploaded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks import _measure

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "bench"


class DelayProxy:
    """A TCP proxy to ``target`` (host, port) that delays the first chunk of
    each response by ``latency_s`` and counts bytes each way."""

    def __init__(self, target: tuple[str, int], latency_s: float):
        self.target, self.latency_s = target, latency_s
        self.down = self.up = self.requests = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            waiting = threading.Event()  # a request went out, its answer not yet back
            threading.Thread(
                target=self._pump, args=(client, upstream, waiting, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, waiting, False), daemon=True
            ).start()

    def _pump(self, src, dst, waiting, is_request):
        try:
            while data := src.recv(1 << 16):
                if is_request:
                    self.up += len(data)
                    waiting.set()
                else:
                    if waiting.is_set():
                        time.sleep(self.latency_s)
                        waiting.clear()
                        self.requests += 1
                    self.down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._server.close()


def _filesystem(port: int):
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="testing",
        secret_key="testing", region="us-east-1", allow_bucket_creation=True,
    )  # fmt: skip


def on_rank(rank: int, world: int, port: int, export_port: int | None) -> dict:
    import transformers.models.llama.modeling_llama  # noqa: F401

    from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
    from ray_fsdp_backend.hf.models import build_causal_lm

    fs = _filesystem(port)
    config = FSDPConfig(use_fsdp=True, use_mixed_precision=False)
    strategy = build_strategy(config, device=torch.device("cpu"), local_rank=rank)
    uri = f"s3://{BUCKET}/llama"
    model = strategy.wrap(build_causal_lm(uri, filesystem=fs))
    _measure.barrier()
    start = time.perf_counter()
    reader = load_pretrained(model, uri, filesystem=fs)
    _measure.barrier()
    load_s = _measure.max_over_ranks([time.perf_counter() - start])[0]
    out = {"load_s": load_s, "max_rank_read": _measure.max_over_ranks([reader.bytes_read])[0]}
    if export_port:
        from ray_fsdp_backend.hf import export_model
        from tests.counting_fs import RoundTrips

        counted = RoundTrips(_filesystem(export_port), latency=0.0)
        _measure.barrier()
        start = time.perf_counter()
        export_model(model, f"s3://{BUCKET}/export-{world}", filesystem=counted.filesystem)
        out["export_s"] = _measure.max_over_ranks([time.perf_counter() - start])[0]
        written = [None] * world
        torch.distributed.all_gather_object(written, counted.bytes_written)
        out["export_bytes_per_rank"] = written
    return out


def make_checkpoint(root: str, dim: int, layers: int, vocab: int) -> tuple[str, int, int]:
    """A random Llama in bf16 shards; (path, weight bytes, tensors)."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=8 * dim // 3,
        num_hidden_layers=layers, num_attention_heads=max(1, dim // 64),
        num_key_value_heads=max(1, dim // 64),
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    path = os.path.join(root, "llama")
    model.save_pretrained(path, max_shard_size="20MB")
    size = sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )
    return path, size, len(model.state_dict())


def _baseline_pythonpath(commit: str, root: str) -> str:
    """A directory whose ``ray_fsdp_backend`` is the package at ``commit``."""
    tree = os.path.join(root, "baseline")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", tree, commit],
                   check=True, capture_output=True)  # fmt: skip
    shim = os.path.join(root, "shim")
    os.makedirs(shim)
    os.symlink(os.path.join(tree, "ray_fsdp_backend"), os.path.join(shim, "ray_fsdp_backend"))
    return f"{shim}{os.pathsep}{ROOT}"


def _run_side(world: int, port: int, pythonpath: str | None, export_port, cwd: str,
              run_ranks) -> dict:  # fmt: skip
    """One side at one world size, in a fresh interpreter (the package under test first);
    ``pythonpath`` None: this interpreter's package, on ``run_ranks`` (the quick
    run, which has one side only)."""
    if pythonpath is None:
        return json.loads(json.dumps(run_ranks(on_rank, world, port, export_port)))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    code = (
        "import json, sys; from benchmarks.hf_s3 import on_rank; "
        "from tests.dist.harness import run_ranks; "
        f"print('RESULT' + json.dumps(run_ranks(on_rank, {world}, {port}, {export_port})))"
    )
    # cwd elsewhere: ``python -c`` puts the working directory first on sys.path.
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=cwd
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    if done.returncode or not lines:
        raise RuntimeError(f"benchmark side failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT") :])


def run(worlds, dim, layers, vocab, latency_s, baseline, run_ranks=None) -> dict:
    """Both sides at each world size (only "after" without ``baseline``);
    ``run_ranks``: the gloo harness's (the default) or a rank pool's."""
    import pyarrow.fs as pafs

    from tests.conftest import moto_server

    if run_ranks is None:
        from tests.dist.harness import run_ranks

    with tempfile.TemporaryDirectory() as root, moto_server() as server:
        path, size, tensors = make_checkpoint(root, dim, layers, vocab)
        files = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
        direct = _filesystem(server.port)
        direct.create_dir(BUCKET)
        pafs.copy_files(path, f"{BUCKET}/llama", destination_filesystem=direct)
        proxy = DelayProxy(("127.0.0.1", server.port), latency_s)
        export_proxy = DelayProxy(("127.0.0.1", server.port), latency_s)
        sides = [("after", None)]
        if baseline:  # the quick run skips it; both sides in fresh interpreters then
            sides = [("before", _baseline_pythonpath(baseline, root)), ("after", str(ROOT))]
        rows = []
        try:
            for world in worlds:
                row = {"world_size": world}
                for side, pythonpath in sides:
                    proxy.down = proxy.up = proxy.requests = 0
                    export_port = export_proxy.port if side == "after" else None
                    got = _run_side(world, proxy.port, pythonpath, export_port, root, run_ranks)
                    got["store_bytes_down"], got["requests"] = proxy.down, proxy.requests
                    if export_port:
                        got["export_requests"], got["export_bytes_up"] = (
                            export_proxy.requests,
                            export_proxy.up,
                        )
                        export_proxy.requests = export_proxy.up = 0
                    row[side] = got
                rows.append(row)
        finally:
            proxy.close()
            export_proxy.close()
            if baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                os.path.join(root, "baseline")], capture_output=True)  # fmt: skip
    return {
        "checkpoint_bytes": size, "tensors": tensors, "files": files, "latency_s": latency_s,
        "baseline": baseline, "rows": rows,
    }  # fmt: skip
