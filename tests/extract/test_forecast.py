"""Disk forecast: pure rules as tables; `extract --forecast` and the job's own refusal in subprocesses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.extract.planning.forecast import (
    HEADER_BYTES,
    disk_state,
    element_bytes,
    engine_dtype,
    file_bytes,
    fits,
    forecast_counts,
    sample_indices,
)
from agent.extract.planning.preflight import vllm_version
from tests.extract.jobrun import ROOT, job_env, parse_events

L, H = 4, 64  # 4 layers (EAGLE-3 default of an 8-layer model), hidden 64


def test_file_bytes_is_the_writers_layout() -> None:
    assert file_bytes(10, L, H, 2) == HEADER_BYTES + 10 * (8 + L * H * 2)
    assert (
        element_bytes("torch.float32") == 4 and element_bytes("bfloat16") == 2 and element_bytes("auto") == 2
    )


@pytest.mark.parametrize(
    ("args", "config", "cpu_float32", "want"),
    [
        ([], {"torch_dtype": "float32"}, False, "bfloat16"),  # vLLM's 'auto' downcasts a float32 checkpoint
        ([], {"torch_dtype": "float16"}, False, "float16"),
        ([], {"torch_dtype": "bfloat16"}, True, "float32"),  # the job's default on a CPU without bf16
        (["--dtype", "float16"], {"torch_dtype": "float32"}, True, "float16"),  # the user's wins
        (["--dtype=float32"], {"torch_dtype": "float32"}, False, "float32"),
        (["--dtype", "auto"], {"dtype": "float16"}, False, "float16"),
        (["--dtype", "auto"], {"dtype": "float16"}, True, "float16"),  # no default over the user's auto
        ([], {}, False, "bfloat16"),
    ],
)
def test_engine_dtype(args: list[str], config: dict[str, str], cpu_float32: bool, want: str) -> None:
    assert engine_dtype(args, config, cpu_float32) == want


def test_exact_and_estimated_forecasts() -> None:
    exact = forecast_counts([10, 20], 2, L, H, 2, free=10**9)
    assert exact.bytes == file_bytes(10, L, H, 2) + file_bytes(20, L, H, 2)
    assert (exact.fits, exact.estimated, exact.samples, exact.tokens) == (True, False, 2, 30)
    # 2 rows read out of 1000: scaled up and said so
    est = forecast_counts([10, 20], 1000, L, H, 2, free=10**9)
    assert est.estimated and est.bytes == 500 * exact.bytes and est.tokens == 15000
    assert not forecast_counts([10, 20], 1000, L, H, 2, free=est.bytes).fits  # no margin left


@pytest.mark.parametrize(
    ("nbytes", "free", "ok"), [(100, 110, True), (100, 109, False), (0, 0, True), (10**15, 10**12, False)]
)
def test_fits_keeps_a_ten_percent_margin(nbytes: int, free: int, ok: bool) -> None:
    assert fits(nbytes, free) is ok


@pytest.mark.parametrize(
    ("free", "remaining", "low", "want"),
    [(50, 10, 20, False), (15, 10, 20, True), (50, 60, 20, True), (50, 0, 0, False)],
)
def test_disk_state(free: int, remaining: int, low: int, want: bool) -> None:
    assert disk_state(free, remaining, low) is want


def test_sample_indices_spread_over_the_file() -> None:
    assert sample_indices(5, k=10) == set(range(5))
    picked = sample_indices(10_000, k=100)
    assert len(picked) == 100 and min(picked) == 0 and max(picked) >= 9_900


def _model(tmp_path: Path, hidden: int = H) -> Path:
    """A model directory with only the config.json the forecast reads (no weights: nothing is loaded)."""
    d = tmp_path / "model"
    d.mkdir()
    cfg = {"num_hidden_layers": 8, "hidden_size": hidden, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _run(tmp_path: Path, spec: dict[str, object], *extra: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"host": "local", **spec}))
    return subprocess.run(
        [sys.executable, "-m", "agent", "extract", "--spec", str(path), *extra],
        cwd=ROOT,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("rows", [7, 2500])
def test_forecast_command_prints_one_object_and_starts_nothing(tmp_path: Path, rows: int) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"token_ids": list(range(5 + i % 3))}) + "\n" for i in range(rows)))
    out_dir = tmp_path / "not-yet" / "out"
    spec = {"model": str(_model(tmp_path)), "dataset": str(data), "output_dir": str(out_dir), "seq_len": 6}
    spec["vllm_args"] = ["--dtype", "float32"]  # 4 bytes a value on any CPU (test_engine_dtype: the default)
    p = _run(tmp_path, spec, "--forecast")
    assert p.returncode == 0, p.stderr
    (line,) = p.stdout.splitlines()
    got = json.loads(line)
    assert {"bytes", "free_bytes", "fits", "estimated"} <= set(got)
    lengths = [min(5 + i % 3, 6) for i in range(rows)]  # truncated to seq_len
    exact = sum(file_bytes(t, L, H, 4) for t in lengths)
    assert got["estimated"] is (rows > 2000)
    assert abs(got["bytes"] - exact) <= exact * 0.01 and got["samples"] == rows
    assert got["fits"] is True and 0 < got["free_bytes"] <= shutil.disk_usage(tmp_path).free * 1.01
    assert not out_dir.parent.exists()  # nothing made, no engine
    assert "EAGLEWATCH" not in p.stdout


def test_forecast_command_names_a_bad_spec(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"token_ids": [1]}\n')
    spec = {"model": str(tmp_path / "nope"), "dataset": str(data), "output_dir": str(tmp_path / "o")}
    p = _run(tmp_path, spec, "--forecast")
    assert p.returncode == 2 and p.stdout == "" and "does not exist" in p.stderr


@pytest.mark.skipif(vllm_version() is None, reason="the job's preflight needs an installed vLLM")
def test_job_refuses_output_that_cannot_fit(tmp_path: Path) -> None:
    """hidden 2**20 × 4 layers × 4 bytes = 16 MiB a token: 200k tokens need ~3.3 TB, more than a test disk."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"token_ids": [1] * 200_000}) + "\n")
    spec = {
        "model": str(_model(tmp_path, hidden=2**20)),
        "dataset": str(data),
        "output_dir": str(tmp_path / "out"),
        "seq_len": 200_000,
        "vllm_args": ["--dtype", "float32"],
    }
    p = _run(tmp_path, spec)
    assert p.returncode == 2, p.stdout + p.stderr
    events = parse_events(p.stdout)
    forecast, failed = events[-2], events[-1]
    assert forecast["kind"] == "forecast" and forecast["fits"] is False and forecast["estimated"] is False
    assert forecast["bytes"] == file_bytes(200_000, L, 2**20, 4)
    assert (
        failed["kind"] == "failed"
        and "will not fit" in failed["reason"]
        and "allow_disk_overrun" in failed["reason"]
    )
    assert "Initializing a V1 LLM engine" not in p.stdout + p.stderr
