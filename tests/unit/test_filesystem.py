"""resolve_filesystem / to_fsspec: local paths, URIs and a given pyarrow filesystem."""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest

from ray_fsdp_backend.storage.filesystem import is_local, resolve_filesystem, to_fsspec
from ray_fsdp_backend.storage.retrying_fs import unwrap


def test_plain_path_is_local_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = resolve_filesystem("ckpt/a")
    assert is_local(fs) and path == os.path.join(str(tmp_path), "ckpt", "a")


def test_file_uri_and_given_filesystem():
    fs, path = resolve_filesystem("file:///tmp/x")
    assert is_local(fs) and path == "/tmp/x"
    given = pafs.SubTreeFileSystem("/tmp", pafs.LocalFileSystem())
    fs, path = resolve_filesystem("s3://bucket/run", given)
    assert unwrap(fs) is given and path == "bucket/run" and not is_local(fs)


def test_retrying_filesystem_round_trip(tmp_path, monkeypatch):
    """Through the retrying wrapper (over a non-local filesystem): writes
    (held in memory, then streamed above the threshold) land whole,
    ranged reads, listing and deletes work, and it pickles with its budget."""
    import pickle

    from ray_fsdp_backend.storage import retrying_fs
    from ray_fsdp_backend.storage.retry import RetryPolicy

    monkeypatch.setattr(retrying_fs, "STREAM_ABOVE_BYTES", 1000)
    base = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    fs = retrying_fs.with_retries(base, RetryPolicy(budget_s=5))
    assert retrying_fs.with_retries(fs) is fs and unwrap(fs) is base
    data = bytes(range(256)) * 20
    fs.create_dir("d")
    with fs.open_output_stream("d/f.bin") as f:
        f.write(data[:1000])
        assert not (tmp_path / "d" / "f.bin").exists()  # held until closed
        f.write(data[1000:])
    assert (tmp_path / "d" / "f.bin").read_bytes() == data
    with fs.open_input_file("d/f.bin") as f:
        assert f.size() == len(data) and f.read_at(7, 4000) == data[4000:4007]
        f.seek(10)
        assert f.read(5) == data[10:15]
    with to_fsspec(fs).open("d/f.bin", "rb") as f:
        assert f.read() == data
    listed = fs.get_file_info(pafs.FileSelector("d"))
    assert [i.path for i in listed] == ["d/f.bin"]
    again = pickle.loads(pickle.dumps(fs))
    assert again.handler.policy.budget_s == 5 and unwrap(again).equals(base)
    fs.delete_dir("d")
    assert not (tmp_path / "d").exists()
    with pytest.raises(FileNotFoundError):  # a first attempt's NotFound is an answer
        fs.delete_dir("d")


def test_unknown_scheme_names_the_uri():
    with pytest.raises(ValueError, match="nosuch://b/x"):
        resolve_filesystem("nosuch://b/x")


def test_fsspec_wrapper_reads_byte_ranges(tmp_path):
    (tmp_path / "f.bin").write_bytes(bytes(range(100)))
    fs = to_fsspec(pafs.LocalFileSystem())
    with fs.open(str(tmp_path / "f.bin"), "rb") as f:
        f.seek(10)
        assert f.read(5) == bytes(range(10, 15))


@pytest.mark.parametrize("stream_above", [1 << 20, 1000])
def test_writes_are_whole_or_absent(tmp_path, monkeypatch, stream_above):
    """open_whole commits when its block completes and aborts when it
    raises, locally (``NAME.tmp`` renamed or deleted) and through the
    retrying wrapper (held: nothing uploaded; streamed: deleted); a plain
    output-stream block on the wrapper aborts too, and one opened while
    another exception is being handled still commits."""
    from ray_fsdp_backend.storage import retrying_fs
    from ray_fsdp_backend.storage.retrying_fs import open_whole, with_retries

    monkeypatch.setattr(retrying_fs, "STREAM_ABOVE_BYTES", stream_above)
    staged = with_retries(pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()))
    writes = [
        lambda: open_whole(pafs.LocalFileSystem(), str(tmp_path / "local.bin")),
        lambda: open_whole(staged, "staged.bin"),
        lambda: staged.open_output_stream("plain.bin"),
    ]
    for write in writes:
        with pytest.raises(ValueError, match="boom"), write() as out:
            out.write(b"x" * 5000)
            raise ValueError("boom")
    assert os.listdir(tmp_path) == []
    try:
        raise KeyError("handled")
    except KeyError:
        for write in writes:
            with write() as out:
                out.write(b"y" * 3000)
    assert sorted(os.listdir(tmp_path)) == ["local.bin", "plain.bin", "staged.bin"]
    assert (tmp_path / "staged.bin").read_bytes() == b"y" * 3000


def test_sdk_retries_span_the_budget():
    """The S3 client's retries of one part wait (25 ms * 2**k before retry k)
    at most the budget, and one more retry would wait past it."""
    from ray_fsdp_backend.storage.retrying_fs import sdk_retries

    def waited(retries):
        return sum(0.025 * 2**k for k in range(1, retries + 1))

    for budget in (1.0, 10.0, 60.0, 120.0):
        n = sdk_retries(budget)
        assert waited(n) <= budget < waited(n + 1), (budget, n)
    assert sdk_retries(0.1) == 3  # never below pyarrow's default
