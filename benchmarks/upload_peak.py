"""Peak memory of one large tensor streamed to the moto S3 server in one write.

The Hugging Face exporter hands each gathered tensor to
:func:`ray_fsdp_backend.retrying_fs.open_whole`'s file in one ``write``.
Each mode runs in a fresh process: it allocates the tensor's bytes, notes
its peak RSS, writes them in one call through the retry layer and reports
how far the peak rose during the write and the commit.

- ``pieces``: the layer as it is, handing the client at most
  ``WRITE_PIECE_BYTES`` at a time (the window then bounds the memory);
- ``whole``: the same with the piece as large as the write (as before:
  the small-file buffer copied the whole tensor, then the client copied it
  again before the window was checked).

    python -m benchmarks.upload_peak                 # a 192 MiB tensor
    python -m benchmarks.upload_peak --mib 512
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

from benchmarks.upload_stream import _SERVER, BUCKET, MIB, _filesystem

MODES = ("pieces", "whole")


def upload(mode: str, port: int, mib: int, window_mib: int | None = None) -> dict:
    """One write of ``mib`` MiB in this process; the rise of its peak RSS
    (``window_mib``: the upload window, default ``UPLOAD_WINDOW_BYTES``)."""
    import resource

    import numpy as np

    from ray_fsdp_backend import retrying_fs

    if window_mib is not None:
        retrying_fs.UPLOAD_WINDOW_BYTES = window_mib * MIB
    if mode == "whole":
        retrying_fs.WRITE_PIECE_BYTES = mib * MIB
    data = np.random.default_rng(0).integers(0, 256, mib * MIB, dtype=np.uint8)
    fs = retrying_fs.with_retries(_filesystem(port))
    path = f"{BUCKET}/{mode}.safetensors"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with retrying_fs.open_whole(fs, path) as out:
        out.write(data)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = fs.get_file_info(path).size
    fs.delete_file(path)
    window = retrying_fs.UPLOAD_WINDOW_BYTES / MIB
    return dict(mode=mode, mib=mib, window_mib=window, bytes=size, rise_mib=(after - before) / MIB)


def run(mib: int) -> dict:
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
        with s3.open_output_stream(f"{BUCKET}/warm-up") as out:  # moto's first request is slow
            out.write(b"x" * MIB)
        return {mode: in_child(mode, port, mib) for mode in MODES}
    finally:
        server.stdin.close()
        server.wait(timeout=60)


def in_child(mode: str, port: int, mib: int, window_mib: int | None = None) -> dict:
    """:func:`upload` in a fresh process (its peak RSS its own)."""
    code = (
        "import json, sys; from benchmarks.upload_peak import upload; "
        "w = int(sys.argv[4]) if sys.argv[4] else None; "
        "print(json.dumps(upload(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), w)))"
    )
    args = [mode, str(port), str(mib), str(window_mib or "")]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the {mode} upload failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=192, help="the tensor's size")
    args = parser.parse_args(argv)
    result = run(args.mib)
    for mode, row in result.items():
        print(f"{mode:7s} one {args.mib} MiB write: peak RSS +{row['rise_mib']:.1f} MiB "
              f"({row['bytes']} bytes stored)")  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
