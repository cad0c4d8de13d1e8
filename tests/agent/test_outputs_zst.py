"""zstd-compressed safetensors (vLLM's online connector with compression), written for real with zstandard."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from agent.checks.checker import Expectation, check_path, is_capture_file

zstd = pytest.importorskip("zstandard")

T, L, H = 16, 4, 32
EXPECT = Expectation(layers=L, hidden_size=H)
REPO = Path(__file__).resolve().parents[2]


def raw_st(hs: torch.Tensor | None = None) -> bytes:
    hs = torch.randn(T, L, H).bfloat16() if hs is None else hs
    return save({"token_ids": torch.arange(hs.shape[0]), "hidden_states": hs})


def one_shot(path: Path, data: bytes) -> Path:
    path.write_bytes(zstd.ZstdCompressor(level=3).compress(data))  # frame records the content size
    return path


def streamed(path: Path, data: bytes) -> Path:
    buf = io.BytesIO()
    with zstd.ZstdCompressor().stream_writer(buf, closefd=False) as w:  # size unknown to the frame
        for i in range(0, len(data), 1000):
            w.write(data[i : i + 1000])
    path.write_bytes(buf.getvalue())
    return path


def test_names() -> None:
    assert is_capture_file("hs_3.safetensors.zst") and is_capture_file("cmpl-1.safetensors.zst")
    assert not is_capture_file("hs_3.safetensors.zst.lock")


@pytest.mark.parametrize("write", [one_shot, streamed])
def test_good_file(tmp_path: Path, write: object) -> None:
    path = write(tmp_path / "hs_0.safetensors.zst", raw_st())  # type: ignore[operator]
    report = check_path(path, EXPECT)
    assert report.ok and report.files == 1 and report.format == "safetensors", report.to_dict()
    assert zstd.frame_content_size(path.read_bytes()[:18]) == (-1 if write is streamed else len(raw_st()))


@pytest.mark.parametrize("write", [one_shot, streamed])
def test_truncated_file_is_unreadable(tmp_path: Path, write: object) -> None:
    full = write(tmp_path / "full.zst", raw_st())  # type: ignore[operator]
    path = tmp_path / "hs_0.safetensors.zst"
    path.write_bytes(full.read_bytes()[:-40])
    for deep in (True, False):
        (p,) = check_path(path, EXPECT, deep=deep).problems
        assert p.code == "unreadable" and "truncated" in p.message, p.message


def test_corrupt_stream_and_wrong_magic(tmp_path: Path) -> None:
    good = one_shot(tmp_path / "x.zst", raw_st()).read_bytes()
    bad = tmp_path / "hs_0.safetensors.zst"
    bad.write_bytes(good[:30] + bytes(b ^ 0x5A for b in good[30:60]) + good[60:])
    (p,) = check_path(bad, EXPECT).problems
    assert p.code == "unreadable"
    plain = tmp_path / "hs_1.safetensors.zst"
    plain.write_bytes(raw_st())  # not compressed at all
    (p,) = check_path(plain, EXPECT).problems
    assert p.code == "unreadable" and "not a zstd stream" in p.message


def test_shape_and_value_problems_inside(tmp_path: Path) -> None:
    hs = torch.randn(T, L, H)
    hs[9, 2, 1] = float("nan")
    one_shot(tmp_path / "hs_0.safetensors.zst", raw_st(hs.bfloat16()))
    one_shot(tmp_path / "hs_1.safetensors.zst", raw_st(torch.randn(T, 3, H).bfloat16()))
    (tmp_path / "hs_2.safetensors").write_bytes(raw_st())
    one_shot(tmp_path / "hs_4.safetensors.zst", raw_st())
    one_shot(tmp_path / "hs_5.safetensors.zst", b"\0")
    (tmp_path / "hs_5.safetensors.lock").touch()  # lock on the uncompressed name counts too
    report = check_path(tmp_path, EXPECT)
    assert sorted((p.code, Path(p.file).name) for p in report.problems) == [
        ("index_gap", tmp_path.name),
        ("layer_count_mismatch", "hs_1.safetensors.zst"),
        ("non_finite", "hs_0.safetensors.zst"),
    ]
    assert "hs_3" in next(p.message for p in report.problems if p.code == "index_gap")
    assert report.unchecked == [str(tmp_path / "hs_5.safetensors.zst")]
    assert report.format == "safetensors"


def test_sniffed_by_magic(tmp_path: Path) -> None:
    one_shot(tmp_path / "sample.bin", raw_st(torch.randn(T, 2, H).bfloat16()))
    assert [p.code for p in check_path(tmp_path / "sample.bin", EXPECT).problems] == ["layer_count_mismatch"]


def test_without_zstandard_it_is_unchecked(tmp_path: Path) -> None:
    one_shot(tmp_path / "hs_0.safetensors.zst", raw_st())
    (tmp_path / "hs_1.safetensors").write_bytes(raw_st())
    code = (
        "import sys, json\n"
        "sys.modules['zstandard'] = None\n"
        "from agent.checks.checker import check_path\n"
        "print(json.dumps(check_path(sys.argv[1]).to_dict()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["files"] == 1
    assert report["unchecked"] == [str(tmp_path / "hs_0.safetensors.zst")]
    assert (
        "1 file unchecked: zstandard is not importable (needed for .safetensors.zst files)" in report["notes"]
    )
