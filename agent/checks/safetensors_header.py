"""Strict, stdlib-only reader of a safetensors header (8-byte little-endian length + JSON); no tensor data."""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bits per element; the official format also allows sub-byte float types (byte length = bits * numel / 8).
DTYPE_BITS: dict[str, int] = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 8),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 16),
    **dict.fromkeys(("I32", "U32", "F32"), 32),
    **dict.fromkeys(("I64", "U64", "F64", "C64"), 64),
    **{"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6},
}

# The reference implementation refuses headers above 100 MB; a bigger length means a corrupt prefix.
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """The file is not a well-formed safetensors file; the message says exactly what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: dtype, shape and its byte range relative to the start of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A validated header: tensors by name, where the data section starts, and free-form metadata."""

    tensors: dict[str, TensorInfo]
    data_start: int
    metadata: dict[str, str]


def header_length(prefix: bytes, file_size: int) -> int:
    """Validate the 8-byte length prefix against the file size and return the JSON header's length."""
    if file_size < 8:
        raise HeaderError(
            f"file is {file_size} byte{'s' if file_size != 1 else ''}: too short for the 8-byte header length"
        )
    if len(prefix) < 8:
        raise HeaderError(
            f"data ended after {len(prefix)} bytes, inside the 8-byte header length (truncated?)"
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(
            f"header length field says {n} bytes, over the {MAX_HEADER_BYTES}-byte limit (corrupt?)"
        )
    if 8 + n > file_size:
        raise HeaderError(
            f"header length field says {n} bytes but only {file_size - 8} bytes follow it (file truncated?)"
        )
    if n < 2:
        raise HeaderError(f"header length field says {n} bytes: too short for a JSON object")
    return int(n)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise HeaderError(f"header names {key!r} twice")
        out[key] = value
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor(name: str, entry: Any, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise HeaderError(f"tensor {name!r}: entry is {type(entry).__name__}, expected an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise HeaderError(f"tensor {name!r}: entry lacks {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise HeaderError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(
            f"tensor {name!r}: data_offsets {offsets!r} is not a [begin, end] pair with begin <= end"
        )
    begin, end = offsets
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        dims = "[" + ", ".join(map(str, shape)) + "]"
        raise HeaderError(
            f"tensor {name!r}: {dtype} {dims} needs {bits / 8:g} bytes but data_offsets [{begin}, {end}] "
            f"hold {end - begin}"
        )
    if end > data_size:
        raise HeaderError(
            f"tensor {name!r}: data [{begin}, {end}) runs past the end of the data section "
            f"({data_size} bytes; file truncated?)"
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def parse_header(header_bytes: bytes, file_size: int) -> Header:
    """Parse and validate the JSON header (the bytes after the 8-byte length) of a file of file_size bytes."""
    data_start = 8 + len(header_bytes)
    data_size = file_size - data_start
    if data_size < 0:
        raise HeaderError(f"header of {len(header_bytes)} bytes does not fit a file of {file_size} bytes")
    try:
        text = header_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"header is not valid UTF-8 (byte {e.start})") from None
    try:
        raw = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as e:
        raise HeaderError(f"header is not valid JSON: {e.msg} at byte {e.pos}") from None
    except RecursionError:
        raise HeaderError("header JSON is nested too deeply to be a safetensors header") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise HeaderError(f"header JSON holds an impossible value: {e}") from None
    if not isinstance(raw, dict):
        raise HeaderError(f"header is a JSON {type(raw).__name__}, expected an object")
    metadata = raw.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError("__metadata__ is not an object of strings")
    tensors = {name: _tensor(name, entry, data_size) for name, entry in raw.items()}
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (_, prev_end, prev), (begin, _, name) in itertools.pairwise(spans):
        if begin < prev_end:
            raise HeaderError(f"tensors {prev!r} and {name!r} overlap in the data section (byte {begin})")
    return Header(tensors=tensors, data_start=data_start, metadata=metadata)


def read_header(path: str | Path) -> Header:
    """Read and validate a file's safetensors header: at most 8 + header-length bytes are read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        n = header_length(prefix, size)
        header_bytes = f.read(n)
    if len(header_bytes) != n:
        raise HeaderError(f"file shrank while reading: header of {n} bytes cut at {len(header_bytes)}")
    return parse_header(header_bytes, size)
