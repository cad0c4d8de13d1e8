"""The run verdict and the grouping of shape problems (controller/verdict.py), as tables."""

from __future__ import annotations

import pytest

from controller.verdict import CheckTally, file_ranges, group_problems, relative, verdict, verdict_text

FILES = [f"hs_{i}.safetensors" for i in range(24)]


@pytest.mark.parametrize(
    ("state", "tally", "word", "words"),
    [
        ("running", CheckTally(FILES, FILES, 24, 1), None, None),
        ("pending", CheckTally(), None, None),
        # the demo's broken run: every file failed, the run itself exited 0
        (
            "completed",
            CheckTally(FILES, FILES, 24, 1),
            "problems",
            "completed — 24 of 24 files failed shape checks; no file is good; 1 alert raised",
        ),
        (
            "completed",
            CheckTally(FILES, ["hs_3.safetensors", "hs_7.safetensors"], 2, 0),
            "problems",
            "completed — 2 of 24 files failed shape checks; good: hs_0 … hs_2, hs_4 … hs_6, hs_8 … hs_23",
        ),
        ("completed", CheckTally(FILES), "ok", "completed — 24 files passed shape checks"),
        ("completed", CheckTally(), "ok", "completed"),
        (
            "completed",
            CheckTally(FILES, (), 0, 2),
            "problems",
            "completed — 24 files passed shape checks; 2 alerts raised",
        ),
        (
            "completed",
            CheckTally(FILES[:1], (), 1, 0),
            "problems",
            "completed — 1 file passed shape checks; 1 output problem (e.g. missing files)",
        ),
        ("stopped", CheckTally(FILES[:3]), "ok", "stopped — 3 files passed shape checks"),
        ("failed", CheckTally(), "failed", "failed"),
        (
            "lost",
            CheckTally(FILES, FILES, 24, 0),
            "failed",
            "lost — 24 of 24 files failed shape checks; no file is good",
        ),
    ],
)
def test_verdict(state: str, tally: CheckTally, word: str | None, words: str | None) -> None:
    assert verdict(state, tally) == word
    assert verdict_text(state, tally) == words


@pytest.mark.parametrize(
    ("files", "text"),
    [
        (FILES, "hs_0 … hs_23"),
        (list(reversed(FILES)), "hs_0 … hs_23"),
        (["hs_1.safetensors", "hs_2.safetensors", "hs_9.safetensors"], "hs_1, hs_2, hs_9"),
        (["data_0.ckpt.gz", "data_1.ckpt.gz", "data_2.ckpt.gz", "notes.txt"], "data_0 … data_2, notes.txt"),
        (
            [f"hs_{i}.safetensors" for i in range(0, 40, 2)],
            "hs_0, hs_2, hs_4, hs_6, hs_8, hs_10, hs_12, hs_14 and 12 more",
        ),
        (["sub/hs_0.safetensors", "sub/hs_1.safetensors", "sub/hs_2.safetensors"], "sub/hs_0 … sub/hs_2"),
        ([], ""),
    ],
)
def test_file_ranges(files: list[str], text: str) -> None:
    assert file_ranges(files) == text


def test_relative_to_the_output_dir() -> None:
    assert relative("/scratch/out/hs_3.safetensors", "/scratch/out/") == "hs_3.safetensors"
    assert relative("/scratch/out", "/scratch/out") == "."
    assert relative("/elsewhere/hs_3.safetensors", "/scratch/out") == "/elsewhere/hs_3.safetensors"
    assert relative("/scratch/outer/hs_3.safetensors", "/scratch/out") == "/scratch/outer/hs_3.safetensors"


def test_identical_problems_of_24_files_are_one_group() -> None:
    """24 rows with absolute paths → one group, the files relative and as one range."""
    msg = "layer count mismatch: hidden_states has 3 layers, expected 4 (final layer dropped?)"
    rows = [("layer_count_mismatch", f"/scratch/out/hs_{i}.safetensors", msg) for i in range(24)]
    rows.append(
        (
            "non_finite",
            "/scratch/out/hs_5.safetensors",
            "hidden_states of /scratch/out/hs_5.safetensors has NaN",
        )
    )
    rows.append(
        (
            "non_finite",
            "/scratch/out/hs_6.safetensors",
            "hidden_states of /scratch/out/hs_6.safetensors has NaN",
        )
    )
    layer, nan = group_problems(rows, "/scratch/out")
    assert (layer.code, layer.message, layer.count, layer.files_text) == (
        "layer_count_mismatch",
        msg,
        24,
        "hs_0 … hs_23",
    )
    assert layer.files[0] == "hs_0.safetensors"
    assert (nan.count, nan.message, nan.files_text) == (2, "hidden_states of … has NaN", "hs_5, hs_6")
