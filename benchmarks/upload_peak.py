"""Peak memory of one large tensor streamed to the moto S3 server in one write.

The Hugging Face exporter hands each gathered tensor to
:func:`ray_fsdp_backend.storage.retrying_fs.open_whole`'s file in one ``write``.
Each mode runs in a fresh process: it allocates the tensor's bytes, resets
its peak RSS to its current RSS (Linux's ``/proc/self/clear_refs``), writes
them in one call through the retry layer and reports how far the peak rose
above the RSS before the write, during the write and the commit.

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

from benchmarks.upload_stream import BUCKET, MIB, _filesystem, in_child, moto_port

MODES = ("pieces", "whole")


def _reset_peak() -> None:
    """Set this process's peak RSS (``VmHWM``) to its current RSS (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def upload(mode: str, port: int, mib: int, window_mib: int = 0) -> dict:
    """One write of ``mib`` MiB in this process; the rise of its peak RSS
    (``window_mib``: the upload window, 0: ``UPLOAD_WINDOW_BYTES``)."""
    import numpy as np

    from ray_fsdp_backend.storage import retrying_fs

    if window_mib:
        retrying_fs.UPLOAD_WINDOW_BYTES = window_mib * MIB
    if mode == "whole":
        retrying_fs.WRITE_PIECE_BYTES = mib * MIB
    data = np.random.default_rng(0).integers(0, 256, mib * MIB, dtype=np.uint8)
    fs = retrying_fs.with_retries(_filesystem(port))
    path = f"{BUCKET}/{mode}.safetensors"
    _reset_peak()
    before = _kib("VmRSS") * 1024
    with retrying_fs.open_whole(fs, path) as out:
        out.write(data)
    after = _kib("VmHWM") * 1024
    size = fs.get_file_info(path).size
    fs.delete_file(path)
    window = retrying_fs.UPLOAD_WINDOW_BYTES / MIB
    return dict(mode=mode, mib=mib, window_mib=window, bytes=size, rise_mib=(after - before) / MIB)


def run(mib: int) -> dict:
    with moto_port() as port:
        return {mode: in_child("benchmarks.upload_peak", mode, port, mib) for mode in MODES}


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
