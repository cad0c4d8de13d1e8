"""Capture files written for real (safetensors package, hand-made bytes, torch.save, gzip) -> codes."""

from __future__ import annotations

import gzip
import io
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent.checks.checker import Expectation, check_path
from agent.runs.capture_checks import check_events

T, L, H = 12, 4, 64
EXPECT = Expectation(layers=L, hidden_size=H)
#: Every problem code the checker reports, as docs/milestones.md lists them.
CODES = (
    "unreadable",
    "missing_key",
    "hidden_dim_lost",
    "layer_count_mismatch",
    "hidden_size_mismatch",
    "seq_len_mismatch",
    "dtype_unexpected",
    "non_finite",
    "all_zero",
    "index_gap",
)


def st_bytes(tensors: dict[str, tuple[str, list[int], bytes]], header: bytes | None = None) -> bytes:
    """A safetensors file made by hand, so that broken variants can be written byte by byte."""
    meta, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = header if header is not None else json.dumps(meta).encode()
    return struct.pack("<Q", len(head)) + head + data


def good_st_bytes() -> bytes:
    return st_bytes(
        {
            "token_ids": ("I64", [T], torch.arange(T).numpy().tobytes()),
            "hidden_states": ("F32", [T, L, H], torch.randn(T, L, H).numpy().tobytes()),
        }
    )


def st(hs: torch.Tensor, ids: torch.Tensor | None = None, **extra: torch.Tensor) -> Callable[[Path], object]:
    def write(path: Path) -> None:
        tensors = {"token_ids": torch.arange(T) if ids is None else ids, "hidden_states": hs, **extra}
        save_file({k: v for k, v in tensors.items() if v is not None}, str(path))

    return write


def raw(data: bytes) -> Callable[[Path], object]:
    return lambda path: path.write_bytes(data)


def pt(obj: object, gz: bool = False, legacy: bool = False) -> Callable[[Path], object]:
    def write(path: Path) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
        path.write_bytes(gzip.compress(buf.getvalue()) if gz else buf.getvalue())

    return write


def with_nan(x: torch.Tensor, where: tuple[int, ...], value: float = float("nan")) -> torch.Tensor:
    x = x.clone()
    x[where] = value
    return x


def zero_layer(x: torch.Tensor, layer: int) -> torch.Tensor:
    x = x.clone()
    x[:, layer] = 0
    return x


def spec_pt(n_layers: int = L, t: int = T, h: int = H, mask: int = T, **over: object) -> dict[str, object]:
    d: dict[str, object] = {
        "input_ids": torch.arange(t),
        "hidden_states": [torch.randn(t, h).bfloat16() for _ in range(n_layers)],
        "loss_mask": torch.ones(mask, dtype=torch.long),
    }
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def specforge(aux_layers: int = L - 1, h: int = H, **over: object) -> dict[str, object]:
    d: dict[str, object] = {
        "input_ids": torch.arange(T),
        "loss_mask": torch.ones(T, dtype=torch.long),
        "aux_hidden_state": torch.randn(1, T, aux_layers * h).bfloat16(),
        "hidden_state": torch.randn(1, T, h).bfloat16(),
    }
    d.update(over)
    return d


def eagle(h: int = H) -> dict[str, object]:
    return {"input_ids": torch.arange(T), "hidden_state": torch.randn(T, h), "loss_mask": torch.ones(T)}


def truncated(data: bytes, keep: int) -> Callable[[Path], object]:
    return raw(data[:keep])


class Gadget:
    """An arbitrary class: weights_only loading must refuse to unpickle it (no code from capture files)."""


RAND = torch.randn(T, L, H)
GOOD = good_st_bytes()
GOOD_HEAD_LEN = struct.unpack("<Q", GOOD[:8])[0]

# (id, file name, writer, expected codes)
CASES: list[tuple[str, str, Callable[[Path], object], set[str]]] = [
    ("st-good-bf16", "hs_0.safetensors", st(RAND.bfloat16()), set()),
    ("st-good-f16", "hs_0.safetensors", st(RAND.half()), set()),
    ("st-good-f32-req-id", "cmpl-abc-0.safetensors", st(RAND), set()),
    ("st-good-handmade", "hs_0.safetensors", raw(GOOD), set()),
    (
        "st-missing-hidden",
        "hs_0.safetensors",
        lambda p: save_file({"token_ids": torch.arange(T)}, str(p)),
        {"missing_key"},
    ),
    (
        "st-missing-ids",
        "hs_0.safetensors",
        lambda p: save_file({"hidden_states": RAND}, str(p)),
        {"missing_key"},
    ),
    ("st-flat-hidden", "hs_0.safetensors", st(torch.randn(T * L)), {"hidden_dim_lost"}),
    ("st-layers-by-tokens", "hs_0.safetensors", st(torch.randn(L, T)), {"hidden_dim_lost"}),
    ("st-3-layers", "hs_0.safetensors", st(RAND[:, :3].contiguous()), {"layer_count_mismatch"}),
    ("st-no-layer-axis", "hs_0.safetensors", st(RAND[:, 0].contiguous()), {"layer_count_mismatch"}),
    ("st-hidden-32", "hs_0.safetensors", st(RAND[:, :, :32].contiguous()), {"hidden_size_mismatch"}),
    ("st-seq-len", "hs_0.safetensors", st(RAND[:-1].contiguous()), {"seq_len_mismatch"}),
    ("st-int-hidden", "hs_0.safetensors", st(torch.ones(T, L, H, dtype=torch.int32)), {"dtype_unexpected"}),
    ("st-float-ids", "hs_0.safetensors", st(RAND, ids=torch.arange(T).float()), {"dtype_unexpected"}),
    ("st-nan-bf16", "hs_0.safetensors", st(with_nan(RAND, (5, 2, 7)).bfloat16()), {"non_finite"}),
    ("st-inf-f16", "hs_0.safetensors", st(with_nan(RAND, (0, 0, 0), float("inf")).half()), {"non_finite"}),
    ("st-ninf-f32", "hs_0.safetensors", st(with_nan(RAND, (T - 1, 3, H - 1), float("-inf"))), {"non_finite"}),
    ("st-all-zero", "hs_0.safetensors", st(torch.zeros(T, L, H).bfloat16()), {"all_zero"}),
    ("st-neg-zero", "hs_0.safetensors", st(torch.full((T, L, H), -0.0)), {"all_zero"}),
    ("st-one-layer-zero", "hs_0.safetensors", st(zero_layer(RAND, 3).bfloat16()), {"all_zero"}),
    ("st-1-byte", "hs_0.safetensors", raw(b"\x00"), {"unreadable"}),
    ("st-empty", "hs_0.safetensors", raw(b""), {"unreadable"}),
    ("st-cut-in-header", "hs_0.safetensors", truncated(GOOD, 8 + GOOD_HEAD_LEN // 2), {"unreadable"}),
    ("st-cut-in-data", "hs_0.safetensors", truncated(GOOD, len(GOOD) - 100), {"unreadable"}),
    ("st-huge-length", "hs_0.safetensors", raw(struct.pack("<Q", 1 << 40) + b"{}"), {"unreadable"}),
    ("st-bad-json", "hs_0.safetensors", raw(st_bytes({}, header=b'{"token_ids": ')), {"unreadable"}),
    ("st-not-utf8", "hs_0.safetensors", raw(st_bytes({}, header=b'{"\xff": 1}')), {"unreadable"}),
    ("st-json-list", "hs_0.safetensors", raw(st_bytes({}, header=b"[1, 2]")), {"unreadable"}),
    (
        "st-unknown-dtype",
        "hs_0.safetensors",
        raw(st_bytes({"token_ids": ("Q7", [2], b"ab")})),
        {"unreadable"},
    ),
    (
        "st-bytes-vs-shape",
        "hs_0.safetensors",
        raw(st_bytes({"token_ids": ("I64", [3], b"\0" * 16)})),
        {"unreadable"},
    ),
    (
        "st-overlap",
        "hs_0.safetensors",
        raw(
            st_bytes(
                {},
                header=json.dumps(
                    {
                        "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
                        "hidden_states": {"dtype": "F32", "shape": [2, 1, 2], "data_offsets": [8, 24]},
                    }
                ).encode(),
            )
            + b"\0" * 24
        ),
        {"unreadable"},
    ),
    ("pt-good", "data_0.pt", pt(spec_pt()), set()),
    (
        "pt-771x512",
        "data_0.pt",
        pt(spec_pt(t=512, hidden_states=[torch.randn(512).bfloat16() for _ in range(771)], mask=512)),
        {"hidden_dim_lost"},
    ),
    ("pt-3-layers", "data_0.pt", pt(spec_pt(n_layers=3)), {"layer_count_mismatch"}),
    ("pt-hidden-size", "data_0.pt", pt(spec_pt(h=32)), {"hidden_size_mismatch"}),
    ("pt-mask-len", "data_0.pt", pt(spec_pt(mask=T - 2)), {"seq_len_mismatch"}),
    ("pt-no-mask", "data_0.pt", pt(spec_pt(loss_mask=None)), {"missing_key"}),
    (
        "pt-int-hidden",
        "data_0.pt",
        pt(spec_pt(hidden_states=[torch.ones(T, H, dtype=torch.long)] * L)),
        {"dtype_unexpected"},
    ),
    (
        "pt-nan",
        "data_0.pt",
        pt(
            spec_pt(
                hidden_states=[
                    torch.randn(T, H),
                    torch.randn(T, H),
                    with_nan(torch.randn(T, H), (3, 3)),
                    torch.randn(T, H),
                ]
            )
        ),
        {"non_finite"},
    ),
    (
        "pt-zero-layer",
        "data_0.pt",
        pt(spec_pt(hidden_states=[torch.randn(T, H)] * 3 + [torch.zeros(T, H)])),
        {"all_zero"},
    ),
    ("pt-garbage", "data_0.pt", raw(b"this is not a torch file at all"), {"unreadable"}),
    (
        "pt-truncated",
        "data_0.pt",
        lambda p: (pt(spec_pt())(p), p.write_bytes(p.read_bytes()[:300])),
        {"unreadable"},
    ),
    ("pt-good-legacy-pickle", "data_0.pt", pt(spec_pt(), legacy=True), set()),
    (
        "pt-good-stacked-tensor",
        "data_0.pt",
        pt(spec_pt(hidden_states=torch.randn(L, T, H).bfloat16())),
        set(),
    ),
    (
        "pt-stacked-zero-layer",
        "data_0.pt",
        pt(spec_pt(hidden_states=torch.cat([torch.randn(L - 1, T, H), torch.zeros(1, T, H)]))),
        {"all_zero"},
    ),
    ("pt-unsafe-pickle", "data_0.pt", pt(spec_pt(extra=Gadget())), {"unreadable"}),
    ("pt-not-dict", "data_0.pt", pt([torch.randn(T, H)]), {"unreadable"}),
    ("sf-good", "data_0.ckpt", pt(specforge()), set()),
    ("sf-good-gz", "data_0.ckpt.gz", pt(specforge(), gz=True), set()),
    ("sf-2-aux", "data_0.ckpt.gz", pt(specforge(aux_layers=2), gz=True), {"layer_count_mismatch"}),
    (
        "sf-flat-last",
        "data_0.ckpt",
        pt(specforge(hidden_state=torch.randn(1, T).bfloat16())),
        {"hidden_dim_lost"},
    ),
    ("sf-no-aux-key-mask", "data_0.ckpt", pt(specforge(loss_mask=torch.ones(T + 1))), {"seq_len_mismatch"}),
    ("sf-zero-aux", "data_0.ckpt", pt(specforge(aux_hidden_state=torch.zeros(1, T, 3 * H))), {"all_zero"}),
    (
        "sf-gz-truncated",
        "data_0.ckpt.gz",
        lambda p: (pt(specforge(), gz=True)(p), p.write_bytes(p.read_bytes()[:-50])),
        {"unreadable"},
    ),
    ("sf-gz-garbage", "data_0.ckpt.gz", raw(b"\x1f\x8b garbage"), {"unreadable"}),
    ("eagle-good", "data_0.ckpt", pt(eagle()), set()),
    ("eagle-hidden-size", "data_0.ckpt", pt(eagle(h=48)), {"hidden_size_mismatch"}),
    ("unknown-name-safetensors", "sample.bin", raw(GOOD), set()),
    ("unknown-name-torch", "sample.bin", pt(spec_pt()), set()),
    ("unknown-name-gz", "sample.bin", pt(specforge(), gz=True), set()),
    ("unknown-format", "sample.bin", raw(b"hello world, definitely not tensors"), {"unreadable"}),
]


@pytest.mark.parametrize(("name", "writer", "codes"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_capture_file_problem_codes(
    tmp_path: Path, name: str, writer: Callable[[Path], object], codes: set[str]
) -> None:
    path = tmp_path / name
    writer(path)
    report = check_path(path, EXPECT)
    got = {p.code for p in report.problems}
    assert got == codes, [p.message for p in report.problems]
    assert report.ok is (not codes)
    assert report.files == 1 and report.unchecked == []
    for p in report.problems:
        assert p.file == str(path) and p.message


def test_every_problem_code_is_covered_by_the_table() -> None:
    covered = set().union(*(c[3] for c in CASES)) | {"index_gap"}  # index_gap: directory tests below
    assert covered == set(CODES)


def test_771_items_message_names_what_was_expected(tmp_path: Path) -> None:
    path = tmp_path / "data_3.pt"
    pt(spec_pt(t=512, mask=512, hidden_states=[torch.randn(512).bfloat16() for _ in range(771)]))(path)
    report = check_path(path, Expectation(layers=4, hidden_size=7168))
    assert [p.message for p in report.problems] == [
        "hidden dimension lost: 771 items of [512], expected 4 × [512, 7168]"
    ]
    assert report.format == "speculators-pt"


def test_dropped_final_layer_message(tmp_path: Path) -> None:
    path = tmp_path / "hs_0.safetensors"
    st(RAND[:, :3].contiguous().bfloat16())(path)
    report = check_path(path, EXPECT)
    (problem,) = report.problems
    assert (
        problem.message
        == "layer count mismatch: hidden_states has 3 layers, expected 4 (final layer dropped?)"
    )
    # the shape read goes with the check event and its milestone, for the run page
    assert report.to_dict()["shapes"]["hidden_states"] == [T, 3, H]
    events = check_events(path.name, report.to_dict(), line=1)
    assert [e.get("shapes", e.get("fields", {}).get("shapes")) for e in events] == [report.shapes] * 2


def test_unreadable_messages_say_what_is_wrong(tmp_path: Path) -> None:
    cases = {
        "one.safetensors": (b"\x07", "file is 1 byte"),
        "cut.safetensors": (GOOD[:-100], "runs past the end of the data section"),
        "len.safetensors": (struct.pack("<Q", 500) + b"{}", "header length field says 500 bytes but only 2"),
        "json.safetensors": (st_bytes({}, header=b'{"a": '), "header is not valid JSON"),
    }
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        (problem,) = check_path(tmp_path / name).problems
        assert words in problem.message, problem.message


def test_nan_location_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "hs_0.safetensors"
    x = with_nan(with_nan(RAND, (7, 1, 3)), (9, 2, 0))
    st(x.bfloat16())(path)
    (problem,) = check_path(path, EXPECT).problems
    assert problem.message == "hidden_states has 2 NaN/Inf values (first at token 7, layer 1)"


def test_shallow_check_skips_value_scans(tmp_path: Path) -> None:
    path = tmp_path / "hs_0.safetensors"
    st(torch.zeros(T, L, H).bfloat16())(path)
    assert check_path(path, EXPECT, deep=False).ok
    assert not check_path(path, EXPECT, deep=True).ok


def test_value_scan_across_many_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny chunk size forces the scan through many reads; the NaN sits in a late chunk."""
    from agent.checks import tensorfiles

    monkeypatch.setattr(tensorfiles, "CHUNK_BYTES", 3 * L * H * 2)
    big = torch.randn(100, L, H)
    big[97, 3, 11] = float("nan")
    big[:, 2] = 0
    path = tmp_path / "hs_0.safetensors"
    st(big.bfloat16(), ids=torch.arange(100))(path)
    msgs = sorted(p.message for p in check_path(path, EXPECT).problems)
    assert msgs == [
        "hidden_states has 1 NaN/Inf value (first at token 97, layer 3)",
        "hidden_states layer 2 is all zero (of 4 layers)",
    ]


def test_unknown_expectation_checks_what_it_can(tmp_path: Path) -> None:
    path = tmp_path / "hs_0.safetensors"
    st(RAND[:, :3].contiguous())(path)
    assert check_path(path).ok  # 3 layers are fine when nobody said how many to expect
    st(torch.randn(T * L))(path)
    assert {p.code for p in check_path(path).problems} == {"hidden_dim_lost"}


def test_weights_only_refusal_is_reported_not_executed(tmp_path: Path) -> None:
    path = tmp_path / "data_0.pt"
    pt(spec_pt(extra=Gadget()))(path)
    (problem,) = check_path(path, EXPECT).problems
    assert problem.code == "unreadable"
    assert problem.message.startswith("refused: not a weights-only torch file (it asks for ")
    assert "Gadget); only tensors" in problem.message


def test_value_scan_failure_keeps_the_shape_result(tmp_path: Path) -> None:
    """Sparse tensors load fine but cannot be scanned like dense ones: a note, not a crash or a pass."""
    path = tmp_path / "data_0.pt"
    pt(spec_pt(hidden_states=[torch.randn(T, H).to_sparse()] * 3))(path)
    report = check_path(path, EXPECT)
    assert [p.code for p in report.problems] == ["layer_count_mismatch"] and report.files == 1
    assert any("value scan skipped: NotImplementedError" in n for n in report.notes)
