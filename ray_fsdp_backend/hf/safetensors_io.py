"""The safetensors format itself: dtype names, headers read and written.

Written here rather than taken from a library because the readers and
writers of this package work on byte ranges of ``pyarrow.fs`` files (object
storage included), which ``safetensors`` (local files, whole buffers) does
not, and torch's private helper (``torch.distributed.checkpoint._hf_utils``,
2.13) maps every dtype it does not know to float32, so a ``U32`` tensor was
reinterpreted bit for bit. The table is the format's full list
(``safetensors`` 0.8), each name to the torch dtype that holds it.

A file is 8 bytes (little-endian u64: header length), a JSON header (keys
-> dtype, shape, ``data_offsets`` relative to the end of the header; plus
``__metadata__``), padded with spaces to a multiple of 8, then the data.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable

import torch

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # as safetensors: a larger "header" is a corrupt file


class UnsupportedDtypeError(ValueError):
    """A safetensors dtype torch cannot hold, or a cast that loses meaning."""


def to_torch_dtype(name: str, *, file: str, key: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``name``.

    Raises:
        UnsupportedDtypeError: "unsupported dtype X in FILE for KEY".
    """
    if name not in DTYPES:
        raise UnsupportedDtypeError(f"unsupported dtype {name} in {file!r} for {key!r}")
    return DTYPES[name]


def check_cast(source: torch.dtype, target: torch.dtype, *, file: str, key: str) -> None:
    """Refuse a cast by value that loses meaning: complex into a real
    parameter, floating point into an integer or bool one.

    Raises:
        UnsupportedDtypeError: "unsupported dtype X in FILE for KEY: why".
    """
    if source == target:
        return
    why = None
    if source.is_complex and not target.is_complex:
        why = f"cannot cast complex to {target}"
    elif source.is_floating_point and not (target.is_floating_point or target.is_complex):
        why = f"a floating-point tensor into a {target} parameter"
    if why:
        raise UnsupportedDtypeError(
            f"unsupported dtype {NAMES[source]} in {file!r} for {key!r}: {why}"
        )


def cast_as_numbers(tensor: torch.Tensor, dtype: torch.dtype, *, file: str, key: str):
    """``tensor`` as ``dtype`` by value (as ``from_pretrained`` casts a
    checkpoint tensor to a floating-point parameter's dtype: ``U32`` 1 is
    1.0, not the float with the same bits).

    Raises:
        UnsupportedDtypeError: see :func:`check_cast`.
    """
    check_cast(tensor.dtype, dtype, file=file, key=key)
    return tensor.to(dtype)


def parse_header(raw: bytes, *, file: str) -> tuple[dict, int]:
    """``(header dict, byte offset of the data)`` from the first bytes of a
    file (at least the 8-byte length and the header).

    Raises:
        ValueError: the bytes are not a safetensors header.
    """
    (length,) = struct.unpack("<Q", raw[:8])
    if length > _MAX_HEADER or 8 + length > len(raw):
        raise ValueError(f"header length {length} does not fit {file!r}")
    return json.loads(raw[8 : 8 + length]), 8 + length


def build_header(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The header bytes (length, JSON, padding) of a file holding
    ``tensors`` (key, dtype, shape) in that order, data packed without gaps."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
