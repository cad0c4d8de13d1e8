"""zstd-compressed safetensors (`*.safetensors.zst`, vLLM's online connector with compression): one pass.

The whole stream is decompressed (a truncated file only shows at its end), up to the file's bound (a bomb
costs bounded memory and time), scanning hidden_states on the way when asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.checks.safetensors_header import Header, HeaderError, header_length, parse_header
from agent.checks.shapes import ValueStats
from agent.checks.tensorfiles import (
    DRAIN_BYTES,
    BoundedReader,
    DecompressionBomb,
    LoadError,
    decompression_bound,
    optional_module,
    read_exact,
    require_module,
    scan_stream,
)

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_UNKNOWN_SIZE = 1 << 62  # placeholder total while the real size is not known yet


def _read(reader: BoundedReader, n: int) -> bytes:
    # chunk by chunk: a corrupt length field must not allocate its claim before the data is there
    out = bytearray()
    buf = memoryview(bytearray(min(n, DRAIN_BYTES)))
    while len(out) < n:
        want = min(len(buf), n - len(out))
        got = read_exact(reader, buf[:want])
        out += buf[:got]
        if got < want:
            break
    return bytes(out)


def _skip(reader: BoundedReader, n: int) -> None:
    buf = memoryview(bytearray(min(n, DRAIN_BYTES) or 1))
    while n > 0 and (got := read_exact(reader, buf[: min(len(buf), n)])):
        n -= got


def scannable(header: Header) -> bool:
    """Whether ``header`` has a non-empty float hidden_states tensor for the value scan."""
    hs = header.tensors.get("hidden_states")
    return hs is not None and hs.dtype in ("BF16", "F16", "F32") and hs.end > hs.begin


def read_zst(path: Path, deep: bool) -> tuple[Header, ValueStats | None]:
    """Validate a .safetensors.zst file end to end; value stats of hidden_states when deep (and scannable).

    HeaderError for a broken stream or header or a decompression bomb (the message says what), LoadError
    when zstandard is missing.
    """
    zstd: Any = require_module("zstandard")
    with open(path, "rb") as f:
        head = f.read(18)
        if not head.startswith(ZSTD_MAGIC):
            raise HeaderError(f"not a zstd stream: it starts with {head[:4]!r}")
        try:
            declared = int(zstd.frame_content_size(head))
        except zstd.ZstdError:
            declared = -1
        f.seek(0)
        bound = decompression_bound(path.stat().st_size, declared if declared >= 0 else None)
        reader = BoundedReader(zstd.ZstdDecompressor().stream_reader(f, read_across_frames=True), bound)
        size = declared if declared >= 0 else _UNKNOWN_SIZE
        try:
            n = header_length(_read(reader, 8), size)
            header_bytes = _read(reader, n)
            if len(header_bytes) != n:
                raise HeaderError(f"zstd stream ended inside the {n}-byte header (truncated?)")
            header = parse_header(header_bytes, size)
            stats = None
            hs = header.tensors["hidden_states"] if scannable(header) else None
            if deep and hs is not None and optional_module("numpy") is not None:
                _skip(reader, hs.begin)
                try:
                    stats = scan_stream(reader, hs.end - hs.begin, hs.shape, hs.dtype)
                except DecompressionBomb:
                    raise
                except LoadError:
                    raise HeaderError("zstd stream ended inside hidden_states (truncated?)") from None
            _skip(reader, _UNKNOWN_SIZE)
            total = reader.total
        except zstd.ZstdError as e:
            raise HeaderError(f"zstd stream is broken (truncated or corrupt?): {e}") from None
        except DecompressionBomb as e:
            raise HeaderError(str(e)) from None
    if declared >= 0 and total != declared:
        raise HeaderError(f"zstd stream holds {total} bytes but its frame says {declared} (truncated?)")
    need = header.data_start + max((t.end for t in header.tensors.values()), default=0)
    if total < need:
        raise HeaderError(f"decompressed data is {total} bytes but the header needs {need} (truncated?)")
    return header, stats
