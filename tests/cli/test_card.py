"""`eaglewatch runs card RUN`: the dataset card a real job wrote, fetched from a real local agent."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import pytest

from cli.runs import card_lines
from tests.cli.test_commands import cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_runs_card(tmp_path: Path, reap: None) -> None:
    assert (
        cli(
            tmp_path, "hosts", "add", "loc", "--ssh", "local", "--state-dir", str(tmp_path / "agent")
        ).returncode
        == 0
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 8, "hidden_size": 32, "torch_dtype": "float32"})
    )
    data = tmp_path / "data.jsonl"
    data.write_text('{"token_ids": [1, 2, 3]}\n')
    out = tmp_path / "out"
    spec = tmp_path / "spec.json"
    # no weights: the job writes its manifest, then its engine fails to load the model (enough for a card)
    spec.write_text(json.dumps({"model": str(model), "dataset": str(data), "output_dir": str(out),
                                "env": {"HF_TOKEN": "hf_secret_value"}}))  # fmt: skip
    start = cli(tmp_path, "runs", "start", "--host", "loc", "--spec", str(spec))
    assert start.returncode == 0, start.stderr
    run_id = start.stdout.strip()
    deadline = time.monotonic() + 120
    while not (out / "manifest.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    res = cli(tmp_path, "runs", "card", run_id, "--json")
    assert res.returncode == 0, res.stderr
    card = json.loads(res.stdout)
    assert card["model"] == str(model) and card["layer_ids"] == [2, 4, 5, 8] and card["samples_total"] == 1
    assert card["model_config_sha256"] == hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    assert card["vllm_version"] and card["spec"]["dataset"] == str(data)
    assert card["spec"]["env"] == ["HF_TOKEN"] and "hf_secret_value" not in res.stdout  # names, never values
    assert "samples" not in card and card["samples_listed"] == 0
    text = cli(tmp_path, "runs", "card", run_id)
    assert text.returncode == 0 and "[2, 4, 5, 8] (input convention), hidden 32" in text.stdout
    cmd = cli(tmp_path, "runs", "start", "--host", "loc", "--", sys.executable, "-c", "print(1)")
    refused = cli(tmp_path, "runs", "card", cmd.stdout.strip())
    assert refused.returncode == 1 and "watched command" in refused.stderr


def test_card_lines_show_each_layer() -> None:
    card = {"model": "/m", "layer_ids": [2, 10], "layer_convention": "input", "hidden_size": 64,
            "dtype": "bfloat16", "samples_written": 3, "samples_total": 4, "tokens_total": 99,
            "bytes_written": 4096,
            "vllm_version": "0.26.0", "versions": {"torch": "2.11"},
            "layer_stats": {
                "10": {"rms": 2.5, "max_abs": 40.0, "zero_fraction": 0.0, "non_finite": 0},
                "2": {"rms": 0.5, "max_abs": 9.0, "zero_fraction": 0.25, "non_finite": 1}}}  # fmt: skip
    lines = card_lines(card)
    assert "3 of 4 written, 99 tokens, 4096 bytes" in lines[3] and "vLLM 0.26.0, torch 2.11" in lines[4]
    assert [ln.split()[0] for ln in lines[-2:]] == ["2", "10"] and lines[-2].split()[1:] == [
        "0.5",
        "9",
        "0.25",
        "1",
    ]
