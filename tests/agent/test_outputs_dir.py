"""Directory checks: every capture file, index gaps, .lock files, report semantics, model expectations."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent.checks.checker import Expectation, check_path, expectation_from_model
from agent.checks.dirs import index_gaps, is_capture_file

T, L, H = 8, 4, 32
EXPECT = Expectation(layers=L, hidden_size=H)


def hs_file(path: Path, layers: int = L) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {"token_ids": torch.arange(T), "hidden_states": torch.randn(T, layers, H).bfloat16()}, str(path)
    )


def sf_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(
        {
            "input_ids": torch.arange(T),
            "loss_mask": torch.ones(T),
            "aux_hidden_state": torch.randn(1, T, 3 * H),
            "hidden_state": torch.randn(1, T, H),
        },
        buf,
    )
    path.write_bytes(buf.getvalue())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("hs_0.safetensors", True),
        ("hs_12.safetensors", True),
        ("cmpl-3f2a-0.safetensors", True),
        ("data_7.pt", True),
        ("data_7.ckpt", True),
        ("data_7.ckpt.gz", True),
        ("/some/dir/hs_1.safetensors", True),
        ("hs_1.safetensors.lock", False),
        ("hs_1.safetensors.tmp", False),
        (".hs_1.safetensors", False),
        ("data_x.pt", True),  # Model-Optimizer names its files after the conversation
        ("data_x.ckpt", False),
        ("sample_lengths.json", False),
        ("data_config.json", False),
        ("output.log", False),
    ],
)
def test_is_capture_file(name: str, expected: bool) -> None:
    assert is_capture_file(name) is expected


def test_directory_with_gaps_names_the_missing_indices_compactly(tmp_path: Path) -> None:
    for i in (0, 1, 4, 5, 6, 9):
        hs_file(tmp_path / f"hs_{i}.safetensors")
    report = check_path(tmp_path, EXPECT)
    assert report.files == 6 and report.format == "safetensors"
    (gap,) = report.problems
    assert gap.code == "index_gap" and gap.file == str(tmp_path)
    assert gap.message == (
        "index gap: 4 files missing in hs_0.safetensors … hs_9.safetensors: hs_2–hs_3, hs_7–hs_8"
    )
    assert not report.ok


def test_index_gaps_pure_single_and_families() -> None:
    names = [
        "hs_0.safetensors",
        "hs_2.safetensors",
        "data_0.pt",
        "data_1.pt",
        "data_5.ckpt",
        "data_7.ckpt.gz",
    ]
    msgs = sorted(p.message for p in index_gaps("/out", names))
    assert msgs == [
        "index gap: 1 file missing in data_5.ckpt … data_7.ckpt: data_6",
        "index gap: 1 file missing in hs_0.safetensors … hs_2.safetensors: hs_1",
    ]
    many = [f"hs_{i}.safetensors" for i in range(0, 60, 2)]
    (p,) = index_gaps("/out", many)
    assert p.message.endswith(", … (19 more ranges)") and "29 files missing" in p.message


def test_specforge_row_directories_count_as_one_sequence(tmp_path: Path) -> None:
    for i in range(0, 3):
        sf_file(tmp_path / "rows_0-3" / f"data_{i}.ckpt")
    for i in range(3, 5):
        sf_file(tmp_path / "rows_3-6" / f"data_{i}.ckpt")
    (tmp_path / "rows_3-6" / "notes.txt").write_text("not a capture file")
    report = check_path(tmp_path, EXPECT)
    assert report.ok and report.files == 5 and report.format == "specforge-ckpt", report


def test_locked_file_is_unchecked_not_a_problem(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors")
    (tmp_path / "hs_1.safetensors").write_bytes(b"\x01\x02")  # half-written: broken on purpose
    (tmp_path / "hs_1.safetensors.lock").touch()
    hs_file(tmp_path / "hs_2.safetensors")
    report = check_path(tmp_path, EXPECT)
    assert report.ok and report.files == 2 and report.problems == []
    assert report.unchecked == [str(tmp_path / "hs_1.safetensors")]
    assert any("still being written" in n for n in report.notes)
    single = check_path(tmp_path / "hs_1.safetensors", EXPECT)
    assert not single.ok and single.files == 0 and single.unchecked == [str(tmp_path / "hs_1.safetensors")]


def test_lock_named_after_the_stem_also_counts(tmp_path: Path) -> None:
    (tmp_path / "cmpl-9.safetensors").write_bytes(b"\x00")
    (tmp_path / "cmpl-9.lock").touch()
    assert check_path(tmp_path).unchecked == [str(tmp_path / "cmpl-9.safetensors")]


def test_empty_directory_is_not_ok(tmp_path: Path) -> None:
    (tmp_path / "README").write_text("nothing here")
    report = check_path(tmp_path)
    assert not report.ok and report.files == 0 and report.format is None
    assert report.notes == [f"{tmp_path}: no capture files found"]


def test_missing_path_is_not_ok_and_does_not_raise(tmp_path: Path) -> None:
    report = check_path(tmp_path / "nope")
    assert not report.ok and report.files == 0 and report.unchecked == [str(tmp_path / "nope")]
    assert "no such file or directory" in report.notes[0]


def test_mixed_formats_and_problem_per_file(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors")
    hs_file(tmp_path / "hs_1.safetensors", layers=3)
    sf_file(tmp_path / "data_0.ckpt")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "hs_5.safetensors").write_bytes(b"x")  # hidden directories are not looked into
    report = check_path(tmp_path, EXPECT)
    assert report.format == "mixed" and report.files == 3
    assert [(p.code, Path(p.file).name) for p in report.problems] == [
        ("layer_count_mismatch", "hs_1.safetensors")
    ]
    d = report.to_dict()
    assert set(d) == {"ok", "files", "format", "problems", "unchecked", "notes", "shapes"}
    assert d["problems"] == [report.problems[0].to_dict()]
    json.dumps(d)


def write_config(d: Path, cfg: dict[str, object]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_expectation_from_model(tmp_path: Path) -> None:
    llama = write_config(tmp_path / "llama", {"hidden_size": 4096, "num_hidden_layers": 32})
    assert expectation_from_model(llama, [2, 16, 29, 32]) == Expectation(layers=4, hidden_size=4096)
    assert expectation_from_model(llama, None) == Expectation(layers=4, hidden_size=4096)
    assert expectation_from_model(str(llama), [2, 16, 29]) == Expectation(layers=3, hidden_size=4096)
    vl = write_config(
        tmp_path / "vl", {"vision_config": {"hidden_size": 1152}, "text_config": {"hidden_size": 7168}}
    )
    assert expectation_from_model(vl, []) == Expectation(layers=4, hidden_size=7168)
    lang = write_config(tmp_path / "lang", {"hidden_size": 1024, "language_config": {"hidden_size": 2048}})
    assert expectation_from_model(lang, None).hidden_size == 2048
    assert expectation_from_model(tmp_path / "absent", None) == Expectation(layers=4, hidden_size=None)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert expectation_from_model(broken, [1]) == Expectation(layers=1, hidden_size=None)


def test_fifo_named_like_a_capture_file_does_not_block(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors")
    os.mkfifo(tmp_path / "hs_1.safetensors")
    report = check_path(tmp_path, EXPECT)
    assert [(p.code, p.message) for p in report.problems] == [("unreadable", "not a regular file")]


def test_file_gone_before_its_check_is_unchecked_not_a_problem(tmp_path: Path) -> None:
    """A dangling link is what a file moved away mid-walk looks like (speculators renames connector files)."""
    hs_file(tmp_path / "hs_0.safetensors")
    os.symlink(tmp_path / "moved-away", tmp_path / "cmpl-7.safetensors")
    report = check_path(tmp_path, EXPECT)
    assert report.ok and report.files == 1
    assert report.unchecked == [str(tmp_path / "cmpl-7.safetensors")]
    assert "1 file unchecked: vanished while being checked (moved or deleted)" in report.notes


def test_far_apart_indices_are_cheap() -> None:
    (p,) = index_gaps("/out", ["hs_0.safetensors", "hs_99999999999.safetensors"])
    assert p.message == (
        "index gap: 99999999998 files missing in hs_0.safetensors … hs_99999999999.safetensors: "
        "hs_1–hs_99999999998"
    )


def pt_file(path: Path, t: int = T) -> None:
    buf = io.BytesIO()
    torch.save(
        {"input_ids": torch.arange(t), "hidden_states": [torch.randn(t, H)] * L, "loss_mask": torch.ones(t)},
        buf,
    )
    path.write_bytes(buf.getvalue())


def test_sample_lengths_json_finds_lost_trailing_files_and_wrong_lengths(tmp_path: Path) -> None:
    """speculators writes {"<idx>": tokens}; a crash that lost the last files is only visible through it."""
    for i in range(3):
        pt_file(tmp_path / f"data_{i}.pt", t=T if i != 1 else T + 1)
    (tmp_path / "sample_lengths.json").write_text(json.dumps({str(i): T for i in range(5)}))
    report = check_path(tmp_path, EXPECT)
    assert [(p.code, Path(p.file).name, p.message) for p in report.problems] == [
        ("seq_len_mismatch", "data_1.pt", f"{T + 1} tokens but sample_lengths.json records {T}"),
        (
            "index_gap",
            tmp_path.name,
            "index gap: 2 files missing in data_0.pt … data_4.pt: data_3–data_4 "
            "(sample_lengths.json lists 5)",
        ),
    ]
    single = check_path(tmp_path / "data_1.pt", EXPECT)  # the daemon's per-file check sees it too
    assert [p.code for p in single.problems] == ["seq_len_mismatch"]
    assert check_path(tmp_path / "data_0.pt", EXPECT).ok


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"0": "eight"}', '{"x": 8}'])
def test_unusable_sample_lengths_json_is_a_note_not_a_problem(tmp_path: Path, content: str) -> None:
    pt_file(tmp_path / "data_0.pt")
    (tmp_path / "sample_lengths.json").write_text(content)
    report = check_path(tmp_path, EXPECT)
    assert report.ok, report.problems
    assert len(report.notes) == 1 and "sample_lengths.json: ignored" in report.notes[0]


def _shard_manifest(folder: Path, index: int, count: int, start: int, end: int) -> None:
    shard = {"index": index, "count": count, "start": start, "end": end}
    (folder / f"manifest.shard-{index}-of-{count}.json").write_text(json.dumps({"shard": shard}))


def test_index_gaps_inside_shard_ranges_only() -> None:
    names = [f"hs_{i}.safetensors" for i in (0, 1, 2, 3, 7, 8, 9, 11)]
    assert index_gaps("/out", names, ranges=[(0, 4), (7, 10)]) == []
    (p,) = index_gaps("/out", names, ranges=[(0, 4), (7, 12)])
    assert p.message.endswith(": hs_10")  # a hole inside one shard's range still counts
    (p,) = index_gaps("/out", names, listed=[4, 8], ranges=[(0, 4), (7, 10)])
    assert ": hs_4 (" in p.message  # listed outside every range is checked as before


def test_directory_of_two_of_three_shards_is_not_missing_the_third(tmp_path: Path) -> None:
    for i in (0, 1, 2, 6, 7, 8):
        hs_file(tmp_path / f"hs_{i}.safetensors")
    assert [p.code for p in check_path(tmp_path, EXPECT).problems] == ["index_gap"]  # no manifests yet
    _shard_manifest(tmp_path, 0, 3, 0, 3)
    _shard_manifest(tmp_path, 2, 3, 6, 9)
    report = check_path(tmp_path, EXPECT)
    assert report.ok and report.problems == [] and report.files == 6
    (tmp_path / "hs_7.safetensors").unlink()
    (gap,) = check_path(tmp_path, EXPECT).problems
    assert gap.message.endswith(": hs_7")
    # once merged, the directory is one dataset: the middle shard's files are missing
    hs_file(tmp_path / "hs_7.safetensors")
    (tmp_path / "manifest.json").write_text("{}")
    (gap,) = check_path(tmp_path, EXPECT).problems
    assert gap.message.endswith(": hs_3–hs_5")
