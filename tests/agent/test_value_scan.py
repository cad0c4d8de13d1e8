"""The value scan over many chunks: NaN/Inf of either sign in a chunk after the first is counted and placed,
for bf16, f16 and f32 (the chunk size is made small so that a small tensor spans many chunks)."""

from __future__ import annotations

import io
import struct

import pytest

from agent.checks import tensorfiles
from agent.checks.tensorfiles import scan_stream

ROWS, LAYERS, HIDDEN = 64, 2, 8
#: bit patterns: 1.0, -3.0 (finite, sign set), and the non-finite values placed
BITS = {
    "BF16": ("<H", 0x3F80, 0xC040, {"+inf": 0x7F80, "-inf": 0xFF80, "+nan": 0x7FC0, "-nan": 0xFFC1}),
    "F16": ("<H", 0x3C00, 0xC200, {"+inf": 0x7C00, "-inf": 0xFC00, "+nan": 0x7E00, "-nan": 0xFE01}),
    "F32": (
        "<I",
        0x3F800000,
        0xC0400000,
        {"+inf": 0x7F800000, "-inf": 0xFF800000, "+nan": 0x7FC00000, "-nan": 0xFFC00001},
    ),
}


def _tensor(dtype: str, bad: dict[tuple[int, int, int], str]) -> bytes:
    fmt, one, minus_three, special = BITS[dtype]
    values = []
    for t in range(ROWS):
        for layer in range(LAYERS):
            for h in range(HIDDEN):
                values.append(
                    special[bad[(t, layer, h)]] if (t, layer, h) in bad else (one, minus_three)[h % 2]
                )
    return b"".join(struct.pack(fmt, v) for v in values)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorfiles, "CHUNK_BYTES", 256)  # a few rows a chunk: the scan sees 8 to 16 chunks


@pytest.mark.parametrize("dtype", sorted(BITS))
@pytest.mark.parametrize("kind", ["+inf", "-inf", "+nan", "-nan"])
def test_a_non_finite_value_in_a_later_chunk_is_counted_and_placed(dtype: str, kind: str) -> None:
    raw = _tensor(dtype, {(41, 1, 3): kind, (57, 0, 0): kind})
    got = scan_stream(io.BytesIO(raw), len(raw), (ROWS, LAYERS, HIDDEN), dtype)
    assert (got.non_finite, got.first_bad, got.layer_nonzero) == (2, (41, 1), (True, True))


@pytest.mark.parametrize("dtype", sorted(BITS))
def test_finite_values_of_both_signs_pass(dtype: str) -> None:
    raw = _tensor(dtype, {})
    got = scan_stream(io.BytesIO(raw), len(raw), (ROWS, LAYERS, HIDDEN), dtype)
    assert (got.non_finite, got.first_bad, got.layer_nonzero) == (0, None, (True, True))
