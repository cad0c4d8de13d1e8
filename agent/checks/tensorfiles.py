"""Optional tensor I/O: torch loads .pt/.ckpt samples; numpy scans values. Both imported lazily."""

from __future__ import annotations

import functools
import gzip
import importlib
import io
import os
import pickle
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.checks.shapes import Described, TensorMeta, ValueStats, canonical_dtype

# Bytes per value-scan chunk: big enough to amortise per-call overhead, small enough to bound temporaries.
CHUNK_BYTES = 16 << 20

# dtype -> (unsigned view, item size, exponent mask, magnitude mask): a value is NaN/Inf iff all exponent
# bits are set, and zero iff every bit but the sign is clear — integer tests that work for bf16 without a
# bf16 type.
_BITS = {
    "BF16": ("<u2", 2, 0x7F80, 0x7FFF),
    "F16": ("<u2", 2, 0x7C00, 0x7FFF),
    "F32": ("<u4", 4, 0x7F800000, 0x7FFFFFFF),
}


class Reader(Protocol):
    """A binary stream that can fill a buffer (a file, a zstd stream reader)."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class LoadError(Exception):
    """A tensor file could not be loaded or read; the message says why in plain words."""


class DecompressionBomb(LoadError):
    """A compressed stream decompresses past its bound (see decompression_bound)."""


#: Decompressed bytes allowed per compressed byte when the file declares no usable size. Hidden states
#: barely compress (bf16 activations are mostly mantissa noise), so a real capture file sits far below
#: this; zeros compress about a thousandfold under gzip and more under zstd. An all-zero capture is refused
#: as a bomb too, which the message says.
MAX_RATIO = 32
#: Any file may decompress this far, whatever its ratio: small files (tiny models, tests) compress well.
RATIO_FLOOR = 64 << 20
#: Slack past a declared size, so that a stream slightly longer than declared is reported as a mismatch.
SIZE_MARGIN = 1 << 20
DRAIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Bound:
    """How far a compressed file may decompress (limit bytes); declared: the size it gave, if that binds."""

    limit: int
    compressed: int
    declared: int | None

    def exceeded(self) -> DecompressionBomb:
        """The error for a stream that went past limit."""
        why = (
            f"although it declares {self.declared}"
            if self.declared is not None
            else f"more than {MAX_RATIO}× its {self.compressed} compressed bytes"
        )
        return DecompressionBomb(
            f"decompresses past {self.limit} bytes, {why}: a decompression bomb? "
            "(an all-zero capture looks like one)"
        )


def decompression_bound(compressed: int, declared: int | None = None, wrap: int | None = None) -> Bound:
    """The bound for a file of compressed bytes that declares its decompressed size (mod wrap, if given).

    The cap is MAX_RATIO × compressed (at least RATIO_FLOOR). A declared size tightens it to that size plus
    SIZE_MARGIN; with wrap (gzip's ISIZE is mod 2^32) the largest size under the cap that agrees with it.
    """
    cap = max(RATIO_FLOOR, MAX_RATIO * compressed)
    if declared is not None and wrap:
        declared = declared + wrap * ((cap - declared) // wrap) if declared <= cap else None
    if declared is None or declared + SIZE_MARGIN >= cap:
        return Bound(cap, compressed, None)
    return Bound(declared + SIZE_MARGIN, compressed, declared)


class BoundedReader:
    """A Reader that raises the bound's DecompressionBomb once more than bound.limit bytes came through."""

    def __init__(self, raw: Reader, bound: Bound) -> None:
        self.raw = raw
        self.bound = bound
        self.total = 0

    def readinto(self, buffer: memoryview, /) -> int:
        """Fill buffer from the underlying stream; 0 at its end."""
        n = self.raw.readinto(buffer) or 0
        self.total += n
        if self.total > self.bound.limit:
            raise self.bound.exceeded()
        return n


@functools.cache
def optional_module(name: str) -> Any | None:
    """Import name once and return it, or None when it is not importable (never raises ImportError)."""
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or a broken install failing at import time: both mean "not usable"
        return None


def require_module(name: str) -> Any:
    """The imported module, or LoadError naming what is missing."""
    mod = optional_module(name)
    if mod is None:
        raise LoadError(f"{name} is not importable")
    return mod


GZIP_MAGIC = b"\x1f\x8b"
# torch.save writes a zip archive; the legacy format (and plain pickles) start with the PROTO opcode
TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def _expect_magic(head: bytes, magics: tuple[bytes, ...], what: str) -> None:
    if not head.startswith(magics):
        shown = repr(head[:4]) if head else "nothing (empty file)"
        raise LoadError(f"not a {what} it starts with {shown}")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    # torch appends paragraphs of advice after the first sentence; the first sentence says what broke
    first = first.split(". ", 1)[0]
    return first[:300]


def _gzip_isize(path: Path) -> int | None:
    """The gzip trailer's ISIZE (the last member's size mod 2^32); None for a file too short for one."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) < 18:  # 10-byte header + 8-byte trailer
            return None
        f.seek(-4, os.SEEK_END)
        return int(struct.unpack("<I", f.read(4))[0])


def _gunzip(path: Path) -> io.BytesIO:
    bound = decompression_bound(path.stat().st_size, _gzip_isize(path), wrap=1 << 32)
    out = io.BytesIO()
    buf = memoryview(bytearray(DRAIN_BYTES))
    try:
        with gzip.open(path, "rb") as f:
            reader = BoundedReader(f, bound)
            while n := reader.readinto(buf):
                out.write(buf[:n])
    except (OSError, EOFError, zlib.error) as e:
        raise LoadError(f"gzip stream is broken (truncated or corrupt?): {_short(e)}") from None
    out.seek(0)
    return out


def load_torch_file(path: Path) -> Any:
    """torch.load a sample safely (weights_only: no arbitrary pickles), gunzipping gzip files first."""
    torch = require_module("torch")
    with open(path, "rb") as f:
        head = f.read(4)
    source: Path | io.BytesIO = path
    if head.startswith(GZIP_MAGIC):
        source = _gunzip(path)
        _expect_magic(source.read(4), TORCH_MAGIC, "torch (zip or pickle) file inside the gzip stream:")
        source.seek(0)
    elif path.name.endswith(".gz"):
        _expect_magic(head, (GZIP_MAGIC,), "gzip file:")
    else:
        _expect_magic(head, TORCH_MAGIC, "torch file (zip or pickle):")
    try:
        if isinstance(source, io.BytesIO):
            return torch.load(source, map_location="cpu", weights_only=True)
        try:
            # mmap keeps a multi-GB sample off the heap: the shape check never touches the data
            return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(source, map_location="cpu", weights_only=True)
    except (
        OSError,
        EOFError,
        RuntimeError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
    ) as e:
        raise LoadError(f"torch.load failed (truncated or corrupt?): {_short(e)}") from None
    except Exception as e:
        # a weights-only refusal, or anything else torch's unpickler raises on a hostile or corrupt file
        if isinstance(e, pickle.UnpicklingError) and str(e).startswith(_NOT_WEIGHTS_ONLY):
            raise LoadError(_refusal(str(e))) from None
        raise LoadError(f"torch.load failed: {type(e).__name__}: {_short(e)}") from None


#: How torch's weights-only unpickler starts the message of every refusal.
_NOT_WEIGHTS_ONLY = "Weights only load failed"
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _refusal(message: str) -> str:
    """The words for a file the weights-only unpickler refused, naming the global it asked for."""
    found = _GLOBAL.search(message)
    what = f"it asks for {found.group(1)}" if found else "it holds pickle instructions beyond plain data"
    return (
        f"refused: not a weights-only torch file ({what}); only tensors, numbers, strings, lists and dicts "
        "are loaded, and nothing else in it was unpickled or run"
    )


def _meta(torch: Any, value: Any) -> Described:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(d) for d in value.shape), canonical_dtype(str(value.dtype)))
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, torch.Tensor) for v in value):
            return [TensorMeta(tuple(int(d) for d in v.shape), canonical_dtype(str(v.dtype))) for v in value]
        return f"{type(value).__name__} of {len(value)} non-tensor items"
    return type(value).__name__


def describe(obj: Any) -> dict[str, Described]:
    """Shapes and dtypes of a loaded sample dict; LoadError when it is not a dict at all."""
    torch = optional_module("torch")
    if not isinstance(obj, dict):
        raise LoadError(f"content is a {type(obj).__name__}, expected a dict of tensors")
    return {str(k): _meta(torch, v) for k, v in obj.items()}


def torch_layer_stats(layers: list[Any]) -> ValueStats:
    """Value stats of loaded tensors, one per layer, each [T, ...] (a leading batch axis of 1 is dropped)."""
    torch = require_module("torch")
    nonzero: list[bool] = []
    bad = 0
    first: tuple[int, int] | None = None
    for li, t in enumerate(layers):
        if t.dim() == 3 and t.shape[0] == 1:
            t = t[0]
        if t.dim() == 0:
            t = t.reshape(1)
        row = max(1, t[0].numel()) if t.shape[0] else 1
        any_nz = False
        step = max(1, CHUNK_BYTES // (row * t.element_size()))
        for start in range(0, t.shape[0], step):
            chunk = t[start : start + step]
            finite = torch.isfinite(chunk)
            n_bad = int(finite.numel() - finite.sum().item())
            if n_bad:
                bad += n_bad
                if first is None:
                    idx = int(torch.argmax((~finite).reshape(-1).to(torch.uint8)).item())
                    first = (start + idx // row, li)
            any_nz = any_nz or bool(chunk.count_nonzero().item())
        nonzero.append(any_nz)
    return ValueStats(layer_nonzero=tuple(nonzero), non_finite=bad, first_bad=first)


def read_exact(f: Reader, view: memoryview) -> int:
    """readinto until view is full or the stream ends (streams such as zstd readers return short reads)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def scan_safetensors(path: Path, offset: int, nbytes: int, shape: tuple[int, ...], dtype: str) -> ValueStats:
    """Scan one tensor's bytes at an absolute file offset; see scan_stream.

    Reads with readinto rather than np.memmap: a file truncated under us gives a short read (reported), not
    a SIGBUS that would kill the process hosting this check.
    """
    with open(path, "rb") as f:
        f.seek(offset)
        return scan_stream(f, nbytes, shape, dtype)


def scan_stream(f: Reader, nbytes: int, shape: tuple[int, ...], dtype: str) -> ValueStats:
    """Scan the next nbytes of f (one tensor) for NaN/Inf and all-zero layers, chunk by chunk, on raw bits.

    A chunk is all finite when its largest signed value is below the exponent mask and its largest unsigned
    one below sign bit | mask (two reductions, nothing written); only other chunks, and the first ones until
    every layer has shown a non-zero value, get their magnitude bits to count and place NaN/Inf and zeros.
    """
    np = require_module("numpy")
    view, itemsize, exp_mask, mag_mask = _BITS[dtype]
    unsigned, signed = np.dtype(view), np.dtype(view.replace("u", "i"))
    rows = shape[0] if len(shape) >= 2 else 1
    layers = shape[1] if len(shape) == 3 else 1
    row_elems = nbytes // itemsize // max(rows, 1)
    per_layer = row_elems // layers
    row_bytes = row_elems * itemsize
    chunk_rows = max(1, min(rows, CHUNK_BYTES // max(row_bytes, 1)))
    buf = bytearray(chunk_rows * row_bytes)
    scratch = np.empty(chunk_rows * row_elems, dtype=unsigned)
    nonzero = [False] * layers
    bad, first = 0, None
    done = 0
    while done < rows:
        n = min(chunk_rows, rows - done)
        count = n * row_elems
        got = read_exact(f, memoryview(buf)[: n * row_bytes])
        if got != n * row_bytes:
            missing = nbytes - done * row_bytes - got
            raise LoadError(f"file ended {missing} bytes early while reading values (truncated?)")
        if (
            all(nonzero)
            and int(np.frombuffer(buf, dtype=signed, count=count).max()) < exp_mask
            and int(np.frombuffer(buf, dtype=unsigned, count=count).max()) < (mag_mask + 1) | exp_mask
        ):
            done += n  # the usual chunk: nothing to count
            continue
        mag = np.bitwise_and(np.frombuffer(buf, dtype=unsigned, count=count), mag_mask, out=scratch[:count])
        if all(nonzero):
            top = int(mag.max())
        else:
            # only until every layer has shown a non-zero value: usually the first chunk
            maxes = [int(x) for x in mag.reshape(n, layers, -1).max(axis=0).max(axis=1)]
            nonzero = [seen or m > 0 for seen, m in zip(nonzero, maxes, strict=True)]
            top = max(maxes)
        if top >= exp_mask:
            hit = mag >= exp_mask
            bad += int(np.count_nonzero(hit))
            if first is None:
                idx = int(np.argmax(hit))
                first = (done + idx // row_elems, (idx // per_layer) % layers)
        done += n
    return ValueStats(layer_nonzero=tuple(nonzero), non_finite=bad, first_bad=first)
