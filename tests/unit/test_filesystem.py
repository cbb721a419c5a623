"""resolve_filesystem / to_fsspec: local paths, URIs and a given pyarrow filesystem."""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest

from ray_fsdp_backend.filesystem import is_local, resolve_filesystem, to_fsspec


def test_plain_path_is_local_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = resolve_filesystem("ckpt/a")
    assert is_local(fs) and path == os.path.join(str(tmp_path), "ckpt", "a")


def test_file_uri_and_given_filesystem():
    fs, path = resolve_filesystem("file:///tmp/x")
    assert is_local(fs) and path == "/tmp/x"
    given = pafs.SubTreeFileSystem("/tmp", pafs.LocalFileSystem())
    fs, path = resolve_filesystem("s3://bucket/run", given)
    assert fs is given and path == "bucket/run" and not is_local(fs)


def test_unknown_scheme_names_the_uri():
    with pytest.raises(ValueError, match="nosuch://b/x"):
        resolve_filesystem("nosuch://b/x")


def test_fsspec_wrapper_reads_byte_ranges(tmp_path):
    (tmp_path / "f.bin").write_bytes(bytes(range(100)))
    fs = to_fsspec(pafs.LocalFileSystem())
    with fs.open(str(tmp_path / "f.bin"), "rb") as f:
        f.seek(10)
        assert f.read(5) == bytes(range(10, 15))
