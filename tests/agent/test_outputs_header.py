"""The pure safetensors header parser and the pure shape rules, case by case."""

from __future__ import annotations

import json
import struct

import pytest
from safetensors.numpy import save

from agent.checks.safetensors_header import HeaderError, header_length, parse_header
from agent.checks.shapes import Expectation, canonical_dtype, check_shapes


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_header_of_a_file_written_by_the_safetensors_package() -> None:
    import numpy as np

    blob = save({"token_ids": np.arange(5), "hidden_states": np.zeros((5, 2, 3), np.float16)}, {"k": "v"})
    n = header_length(blob[:8], len(blob))
    h = parse_header(blob[8 : 8 + n], len(blob))
    assert h.metadata == {"k": "v"} and h.data_start == 8 + n
    assert h.tensors["hidden_states"].shape == (5, 2, 3) and h.tensors["hidden_states"].dtype == "F16"
    assert h.tensors["token_ids"].end - h.tensors["token_ids"].begin == 40


@pytest.mark.parametrize(
    ("header", "data_size", "words"),
    [
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, "overlap"),
        ({"a": entry("F32", [2], 0, 8)}, 4, "runs past the end of the data section"),
        ({"a": entry("F32", [3], 0, 8)}, 8, "needs 12 bytes"),
        ({"a": entry("F32", [2], 8, 0)}, 8, "begin <= end"),
        ({"a": entry("F32", [-1], 0, 0)}, 0, "not a list of non-negative integers"),
        ({"a": entry("F32", [True], 0, 4)}, 4, "not a list of non-negative integers"),
        ({"a": {"dtype": "F32", "shape": [1]}}, 4, "lacks data_offsets"),
        ({"a": [1, 2]}, 0, "expected an object"),
        ({"a": entry("NOPE", [1], 0, 1)}, 1, "unknown dtype"),
        ({"__metadata__": {"x": 1}}, 0, "__metadata__"),
        ({"a": entry("F4", [3], 0, 2)}, 2, "needs 1.5 bytes"),
    ],
)
def test_bad_headers(header: dict[str, object], data_size: int, words: str) -> None:
    raw = json.dumps(header).encode()
    with pytest.raises(HeaderError, match=words):
        parse_header(raw, 8 + len(raw) + data_size)


def test_duplicate_keys_and_padding() -> None:
    raw = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {}}'
    with pytest.raises(HeaderError, match="twice"):
        parse_header(raw, 8 + len(raw) + 1)
    padded = (
        b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}    '  # the writer pads with spaces
    )
    assert parse_header(padded, 8 + len(padded) + 1).tensors["a"].shape == (1,)


def test_length_prefix() -> None:
    with pytest.raises(HeaderError, match="file is 1 byte"):
        header_length(b"\x00", 1)
    with pytest.raises(HeaderError, match="only 10 bytes follow"):
        header_length(struct.pack("<Q", 11), 18)
    with pytest.raises(HeaderError, match="too short for a JSON object"):
        header_length(struct.pack("<Q", 0), 8)
    assert header_length(struct.pack("<Q", 10), 18) == 10


E = Expectation(layers=4, hidden_size=7168)


@pytest.mark.parametrize(
    ("ids", "hs", "dtype", "expect", "codes"),
    [
        ((512,), (512, 4, 7168), "BF16", E, []),
        ((512,), (512, 4, 7168), "torch.bfloat16", E, []),
        ((1, 512), (512, 4, 7168), "float16", E, []),
        ((512,), (512, 3, 7168), "BF16", E, ["layer_count_mismatch"]),
        ((512,), (512, 5, 7168), "BF16", E, ["layer_count_mismatch"]),
        ((512,), (512, 28672), "BF16", E, ["layer_count_mismatch"]),
        ((512,), (512, 7168), "BF16", E, ["layer_count_mismatch"]),
        ((512,), (4, 512), "BF16", E, ["hidden_dim_lost"]),
        ((512,), (2048,), "BF16", E, ["hidden_dim_lost"]),
        ((512,), (), "BF16", E, ["hidden_dim_lost"]),
        ((512,), (1, 512, 4, 7168), "BF16", E, ["layer_count_mismatch"]),
        ((512,), (511, 4, 4096), "BF16", E, ["seq_len_mismatch", "hidden_size_mismatch"]),
        ((0,), (0, 4, 7168), "BF16", E, ["seq_len_mismatch"]),
        ((2, 256), (512, 4, 7168), "BF16", E, ["seq_len_mismatch"]),
        ((512,), (512, 4, 7168), "F64", E, ["dtype_unexpected"]),
        ((512,), (512, 4, 7168), "I64", Expectation(), ["dtype_unexpected"]),
        ((512,), (512, 9, 123), "F32", Expectation(), []),
    ],
)
def test_check_shapes_table(
    ids: tuple[int, ...], hs: tuple[int, ...], dtype: str, expect: Expectation, codes: list[str]
) -> None:
    problems = check_shapes("f", ids, hs, dtype, expect)
    assert [p.code for p in problems] == codes, [p.message for p in problems]


def test_check_shapes_messages() -> None:
    (p,) = check_shapes("hs_3.safetensors", (512,), (512, 3, 7168), "BF16", E)
    assert p.message == "layer count mismatch: hidden_states has 3 layers, expected 4 (final layer dropped?)"
    assert p.file == "hs_3.safetensors"
    (p,) = check_shapes("f", (512,), (4, 512), "BF16", E)
    assert p.message == "hidden dimension lost: hidden_states is [4, 512], expected [512, 4, 7168]"
    (p,) = check_shapes("f", (512,), (512, 4, 7168), "BF16", E, token_dtype="F32")
    assert p.message == "token_ids is F32, expected an integer dtype"


def test_canonical_dtype() -> None:
    assert [canonical_dtype(d) for d in ("torch.bfloat16", "bfloat16", "BF16", "float32", "torch.int64")] == [
        "BF16",
        "BF16",
        "BF16",
        "F32",
        "I64",
    ]


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (
            b'{"a": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}',
            "impossible value",
        ),
        (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [NaN, 1]}}', "with begin <= end"),
    ],
)
def test_hostile_json_headers(raw: bytes, words: str) -> None:
    with pytest.raises(HeaderError, match=words):
        parse_header(raw, 8 + len(raw) + 1)
