"""Spooled vs streamed: one large shard to the moto S3 server through the
retry layer, written whole or absent both ways.

- ``spooled``: the layer as it was before it streamed (reproduced here by
  :class:`Spooled`): the bytes go to a spool (memory up to 16 MiB, then an
  anonymous temporary file), and are uploaded whole on commit, at most
  64 MiB of parts in flight; a retry uploads the whole file again.
- ``streamed``: :func:`ray_fsdp_backend.storage.retrying_fs.open_whole` on the
  retrying filesystem, as the Hugging Face exporter and DCP's writer use it
  now: past ``STREAM_ABOVE_BYTES`` the bytes go straight into the client's
  multipart upload (parts retried by the S3 client), at most
  ``UPLOAD_WINDOW_BYTES`` queued.

Each mode runs in a fresh process (the moto server in another) writing the
same bytes in 16 MiB chunks, as the exporter writes tensors. Reported per
mode: seconds (median of ``--reps``; and when the writer's last byte was
written, before the commit), the writer's peak RSS, and the local disk the
upload used (the spool file's size, and the drop of free space on
``TMPDIR``'s filesystem, sampled every 10 ms). The overhead is spooled /
streamed - 1.

    python -m benchmarks.upload_stream                # a 1 GiB shard, 3 repetitions
    python -m benchmarks.upload_stream --mib 16 --reps 1
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

MIB = 1024 * 1024
CHUNK = 16 * MIB
MODES = ("spooled", "streamed")
BUCKET = "upload-bench"
_SERVER = """
import sys, time
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


def _filesystem(port: int):
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="testing",
        secret_key="testing", region="us-east-1", allow_bucket_creation=True,
        request_timeout=600,  # moto joins a 1 GiB upload's parts in Python: minutes
    )  # fmt: skip


class _DiskWatch:
    """The largest drop of free space on ``path``'s filesystem while running."""

    def __init__(self, path: str):
        self._path, self._start = path, shutil.disk_usage(path).free
        self.peak, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, self._start - shutil.disk_usage(self._path).free)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(0, self.peak)


class Spooled(io.RawIOBase):
    """The whole-file spool the retry layer used before it streamed: memory
    up to 16 MiB, then an anonymous temporary file, uploaded whole on
    commit (retried whole), 64 MiB of parts in flight at most."""

    def __init__(self, fs, path: str):
        super().__init__()
        self._fs, self._path = fs, path
        self.spool = tempfile.SpooledTemporaryFile(max_size=16 * MIB)

    def write(self, data):
        return self.spool.write(data)

    def __exit__(self, kind, exc, tb):
        if exc is None:
            self._fs.handler.retry(self._upload, f"writing {self._path}")
        self.spool.close()
        return False

    def _upload(self) -> None:
        self.spool.seek(0)
        with self._fs.handler.fs.open_output_stream(self._path) as out:
            pending = 0
            while chunk := self.spool.read(8 * MIB):
                out.write(chunk)
                pending += len(chunk)
                if pending >= 64 * MIB:
                    out.flush()
                    pending = 0


def upload(mode: str, port: int, mib: int) -> dict:
    """One upload of ``mib`` MiB in this process; what it cost."""
    import resource

    import numpy as np

    from ray_fsdp_backend.storage import retrying_fs

    s3 = _filesystem(port)
    chunk = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    path = f"{BUCKET}/{mode}.safetensors"
    watch = _DiskWatch(tempfile.gettempdir())
    start = time.perf_counter()
    fs = retrying_fs.with_retries(s3)
    out = Spooled(fs, path) if mode == "spooled" else retrying_fs.open_whole(fs, path)
    spooled = 0
    with out:
        for _ in range(mib * MIB // CHUNK):
            out.write(chunk)
        if mode == "spooled" and out.spool._rolled:  # the spool's file: the local disk used
            spooled = os.fstat(out.spool.fileno()).st_size
        written = time.perf_counter() - start  # the writer's last byte; then the commit
    seconds = time.perf_counter() - start
    disk = watch.stop()
    size = s3.get_file_info(path).size
    s3.delete_file(path)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(mode=mode, seconds=seconds, write_s=written, bytes=size, peak_rss=peak_rss,
                spool_file=spooled, disk_drop=disk)  # fmt: skip


@contextlib.contextmanager
def moto_port() -> Iterator[int]:
    """A moto S3 server in a child process, with :data:`BUCKET` created and
    its first (slow) request made; yields its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        server.stdout.readline()
        s3 = _filesystem(port)
        s3.create_dir(BUCKET)
        with s3.open_output_stream(f"{BUCKET}/warm-up") as out:
            out.write(b"x" * MIB)
        yield port
    finally:
        server.stdin.close()
        server.wait(timeout=60)


def run(mib: int, reps: int) -> dict:
    with moto_port() as port:
        rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for rep in range(reps):  # alternating order: drifting load hits both alike
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                rows[mode].append(in_child("benchmarks.upload_stream", mode, port, mib))
    summary = {
        mode: {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "runs_s": [r["seconds"] for r in runs],
            "write_s": statistics.median(r["write_s"] for r in runs),
            "peak_rss_mib": max(r["peak_rss"] for r in runs) / MIB,
            "spool_file_mib": max(r["spool_file"] for r in runs) / MIB,
            "disk_drop_mib": max(r["disk_drop"] for r in runs) / MIB,
            "bytes": runs[0]["bytes"],
        }
        for mode, runs in rows.items()
    }
    overhead = summary["spooled"]["seconds"] / summary["streamed"]["seconds"] - 1
    return dict(mib=mib, reps=reps, modes=summary, spooled_overhead=overhead)


def in_child(module: str, mode: str, *args: int) -> dict:
    """``module.upload(mode, *args)`` in a fresh process (its peak RSS its own)."""
    code = (
        f"import json, sys; from {module} import upload; "
        "print(json.dumps(upload(sys.argv[1], *map(int, sys.argv[2:]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, mode, *map(str, args)], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"the {mode} upload failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="shard size (a multiple of 16)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    result = run(args.mib, args.reps)
    for mode, row in result["modes"].items():
        runs = ", ".join(f"{t:.1f}" for t in row["runs_s"])
        print(f"{mode:9s} {row['seconds']:7.2f} s ({runs}; writes done at {row['write_s']:.2f} s)  "
              f"peak RSS {row['peak_rss_mib']:7.1f} MiB  "
              f"spool file {row['spool_file_mib']:7.1f} MiB  "
              f"free disk drop {row['disk_drop_mib']:7.1f} MiB")  # fmt: skip
    print(f"spooling overhead: {100 * result['spooled_overhead']:+.1f}% of the streamed upload")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
