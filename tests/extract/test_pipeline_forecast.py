"""Disk forecast and disk progress of the speculators and specforge backends (no engine, no GPU).

speculators' datasets are real ``datasets.save_to_disk`` folders, the form its client reads; its files are
real safetensors files. SpecForge needs SGLang on GPUs, which cannot run here: its file size is checked
against a real ``torch.save`` of its documented layout, and its job runs real torchrun with a stand-in for
``prepare_hidden_states.py`` that writes one file in that layout.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.extract.pipelines.disk import DiskWatch, scan
from agent.extract.pipelines.forecast import (
    flag_value,
    forecast_specforge,
    forecast_speculators,
    rank_window,
    specforge_file_bytes,
    specforge_total,
)
from agent.extract.planning.forecast import file_bytes
from agent.extract.planning.preflight import SpecError
from agent.spec import parse_spec
from tests.extract.jobrun import ROOT, job_env, parse_events

HIDDEN, LAYERS = 32, 8  # EAGLE-3 captures 4 of 8 layers
ROWS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]


def _model(tmp_path: Path, hidden: int = HIDDEN) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    cfg = {"num_hidden_layers": LAYERS, "hidden_size": hidden, "torch_dtype": "bfloat16"}
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def _speculators(tmp_path: Path, columns: dict[str, Any], **over: Any) -> Any:
    from datasets import Dataset

    tmp_path.mkdir(exist_ok=True)
    data = tmp_path / "prep"
    Dataset.from_dict(columns).save_to_disk(str(data))
    spec = {"host": "h", "backend": "speculators", "model": str(_model(tmp_path)), "dataset": str(data),
            "output_dir": str(tmp_path / "out"), **over}  # fmt: skip
    return parse_spec(spec)


def test_speculators_file_size_is_its_safetensors_layout(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file(
        {"token_ids": torch.arange(7), "hidden_states": torch.zeros(7, 4, HIDDEN, dtype=torch.bfloat16)},
        str(tmp_path / "hs_0.safetensors"),
    )
    actual = (tmp_path / "hs_0.safetensors").stat().st_size
    assert actual <= file_bytes(7, 4, HIDDEN, 2) <= actual + 256


def test_specforge_file_size_is_its_torch_save_layout() -> None:
    import torch

    for t, h in ((5, 16), (300, 64)):
        sample = {"input_ids": torch.arange(t), "loss_mask": torch.ones(t, dtype=torch.long),
                  "hidden_state": torch.zeros(1, t, h, dtype=torch.bfloat16),
                  "aux_hidden_state": torch.zeros(1, t, 3 * h, dtype=torch.bfloat16)}  # fmt: skip
        buf = io.BytesIO()
        torch.save(sample, buf)
        actual = len(buf.getvalue())
        assert actual <= specforge_file_bytes(t, h, 2) <= actual + 512


@pytest.mark.parametrize(
    ("target", "world", "rank", "want"),
    [(5, 1, 0, (0, 5)), (5, 2, 0, (0, 3)), (5, 2, 1, (3, 5)), (1, 2, 1, (1, 1))],
)
def test_rank_window_splits_as_speculators_does(
    target: int, world: int, rank: int, want: tuple[int, int]
) -> None:
    assert rank_window(target, world, rank) == want


def test_flag_value_takes_the_last_of_both_spellings() -> None:
    assert flag_value(["--rank", "1", "--rank=2"], "--rank") == "2"
    assert flag_value(["--world-size", "3"], "--rank") is None


def test_speculators_forecast_counts_this_ranks_rows_without_a_file(tmp_path: Path) -> None:
    spec = _speculators(
        tmp_path, {"input_ids": ROWS}, speculators={"client_args": ["--world-size", "2", "--rank", "0"]}
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "hs_1.safetensors").write_bytes(b"x")  # written by an earlier attempt: skipped by the client
    got = forecast_speculators(spec)
    # rank 0 of 2 takes rows 0..2 of 5; row 1 exists: rows 0 and 2 (3 and 4 tokens) are left
    assert got.samples == 2 and got.tokens == 7 and got.estimated is False and got.fits is True
    assert got.bytes == file_bytes(3, 4, HIDDEN, 2) + file_bytes(4, 4, HIDDEN, 2)


def test_speculators_forecast_prefers_seq_len_and_honours_max_samples(tmp_path: Path) -> None:
    spec = _speculators(
        tmp_path,
        {"input_ids": ROWS, "seq_len": [30, 20, 40, 10, 20]},
        max_samples=2,
        vllm_args=["--dtype", "float32"],
    )
    got = forecast_speculators(spec)
    assert got.samples == 2 and got.tokens == 50
    assert got.bytes == file_bytes(30, 4, HIDDEN, 4) + file_bytes(20, 4, HIDDEN, 4)


def test_speculators_forecast_names_a_dataset_it_cannot_read(tmp_path: Path) -> None:
    spec = _speculators(tmp_path, {"input_ids": ROWS})
    bad = spec.model_copy(update={"dataset": str(tmp_path / "sharegpt.jsonl")})
    with pytest.raises(SpecError, match=r"sharegpt\.jsonl is not a directory saved by datasets"):
        forecast_speculators(bad)
    bad_rank = _speculators(tmp_path / "r", {"input_ids": ROWS}, speculators={"client_args": ["--rank", "x"]})
    with pytest.raises(SpecError, match="--rank must be an integer, got 'x'"):
        forecast_speculators(bad_rank)


def _specforge(tmp_path: Path, lines: list[str], hidden: int = HIDDEN, **over: Any) -> Any:
    data = tmp_path / "sharegpt.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    spec = {"host": "h", "backend": "specforge", "model": str(_model(tmp_path, hidden)), "dataset": str(data),
            "output_dir": str(tmp_path / "out"), "specforge": {"scripts_dir": str(tmp_path / "scripts")},
            **over}  # fmt: skip
    return parse_spec(spec)


CONV = json.dumps(
    {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
)


def test_specforge_forecast_is_an_estimate_bounded_by_max_length(tmp_path: Path) -> None:
    """No tokenizer in the model folder: each conversation counts --max-length tokens (an upper bound)."""
    spec = _specforge(
        tmp_path, [CONV] * 4 + ["", json.dumps({"input_ids": [1, 2, 3]})], seq_len=64,
        specforge={"scripts_dir": str(tmp_path / "scripts"), "args": ["--max-length", "16"]},
    )  # fmt: skip
    got = forecast_specforge(spec)
    assert got.estimated is True and got.samples == 5 and got.tokens == 4 * 16 + 3
    assert got.bytes == 4 * specforge_file_bytes(16, HIDDEN, 2) + specforge_file_bytes(3, HIDDEN, 2)
    assert specforge_total(spec) == 5
    limited = spec.model_copy(update={"max_samples": 2})
    assert forecast_specforge(limited).samples == 2 and specforge_total(limited) == 2


def test_specforge_forecast_tokenises_turns_when_the_tokenizer_loads(tmp_path: Path) -> None:
    from agent.extract.tinymodel import build

    model = build(tmp_path / "tiny", "llama")
    conv = json.dumps(
        {"conversations": [{"from": "human", "value": "w1 w2 w3"}, {"from": "gpt", "value": "w4"}]}
    )
    spec = _specforge(tmp_path, [conv]).model_copy(update={"model": str(model)})
    got = forecast_specforge(spec)
    assert got.tokens == 4 + 2 * 8  # four words, eight template tokens per turn


def test_disk_watch_counts_this_attempts_files(tmp_path: Path) -> None:
    group = tmp_path / "rows_0-2000"
    group.mkdir()
    (group / "data_0.ckpt").write_bytes(b"a" * 100)  # from an earlier attempt
    (tmp_path / ".staging-speculators").mkdir()
    (tmp_path / ".staging-speculators" / "hs_9.safetensors").write_bytes(b"s" * 10)  # not moved in yet
    watch = DiskWatch(str(tmp_path), total=4, bytes_todo=0, low_bytes=0)
    watch.begin()
    (group / "data_1.ckpt.gz").write_bytes(b"b" * 50)
    (tmp_path / "hs_2.safetensors").write_bytes(b"c" * 30)
    (tmp_path / "notes.txt").write_text("not a capture file")
    assert scan(str(tmp_path)) == (3, 180)
    got = watch.fields()
    assert got["samples_done"] == got["files_written"] == 2 and got["bytes_written"] == 80
    assert (
        got["samples_total"] == 4 and got["eta_s"] >= 0 and got["disk_low"] is False and got["free_bytes"] > 0
    )
    low = DiskWatch(str(tmp_path), total=None, bytes_todo=1 << 62, low_bytes=0).fields()
    assert low["disk_low"] is True and "samples_total" not in low and "eta_s" not in low


STANDIN = """
import argparse, os, torch
p = argparse.ArgumentParser()
p.add_argument("--output-path")
args, _ = p.parse_known_args()
os.makedirs(os.path.join(args.output_path, "rows_0-2000"), exist_ok=True)
t = 3
torch.save({"input_ids": torch.arange(t), "loss_mask": torch.ones(t, dtype=torch.long),
            "hidden_state": torch.zeros(1, t, 16), "aux_hidden_state": torch.zeros(1, t, 48)},
           os.path.join(args.output_path, "rows_0-2000", "data_0.ckpt"))
print("Generation loop finished. Processed: 1, Skipped: 0", flush=True)
"""


def _job(tmp_path: Path, hidden: int, **over: Any) -> tuple[int, list[dict[str, Any]]]:
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    (scripts / "prepare_hidden_states.py").write_text(STANDIN)
    spec = _specforge(
        tmp_path, [CONV, CONV], hidden,
        specforge={"scripts_dir": str(scripts), "python": sys.executable}, **over,
    ).model_dump(mode="json")  # fmt: skip
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "extract", "--spec", str(path)],
        cwd=ROOT, env=job_env({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc.returncode, parse_events(proc.stdout)


def test_specforge_job_refuses_an_output_that_cannot_fit(tmp_path: Path) -> None:
    """hidden 2**30: 4 × 2**30 × 2 bytes a token, 2 × 2048 tokens: 32 TiB, more than any test disk."""
    rc, events = _job(tmp_path, 2**30)
    (forecast,) = [e for e in events if e["kind"] == "forecast"]
    assert forecast["fits"] is False and forecast["estimated"] is True
    (failed,) = [e for e in events if e["kind"] == "failed"]
    assert rc == 2 and "will not fit" in failed["reason"] and "allow_disk_overrun" in failed["reason"]
    assert not (tmp_path / "out" / "rows_0-2000").exists()  # torchrun never started


def test_specforge_job_with_overrun_allowed_runs_with_a_total_and_disk_progress(tmp_path: Path) -> None:
    rc, events = _job(tmp_path, 2**30, allow_disk_overrun=True)
    assert rc == 0, events
    progress = [e for e in events if e["kind"] == "progress"]
    assert progress[0]["rule"] == "pipeline_total" and progress[0]["samples_total"] == 2
    final = progress[-1]
    assert final["rule"] == "pipeline_disk" and final["files_written"] == 1 and final["samples_total"] == 2
    assert final["disk_low"] is True and final["free_bytes"] > 0  # 32 TiB still to write


def test_a_path_given_again_among_the_tools_flags_is_the_one_forecast(tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text(CONV + "\n")
    spec = _specforge(
        tmp_path,
        [CONV] * 3,
        specforge={"scripts_dir": str(tmp_path / "scripts"), "args": ["--data-path", str(other)]},
    )
    assert forecast_specforge(spec).samples == 1 and specforge_total(spec) == 1
