"""tiny-model (through the real `eaglewatch-agent` entry point), dataset loading, milestone line format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.extract.planning.dataset import DatasetError, load
from agent.extract.signals import emit, format_line
from tests.extract.jobrun import ROOT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "llama"
    p = subprocess.run(
        [sys.executable, "-m", "agent", "tiny-model", str(out), "--arch", "llama", "--seed", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return out


def test_tiny_model_loads_offline_with_fixed_seed(tiny: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.extract.tinymodel import build

    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 8
    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert tok("w0 w1 w495")["input_ids"] == [4, 5, 499]
    again = build(tmp_path / "again", "llama", seed=2)
    a = AutoModelForCausalLM.from_pretrained(str(tiny)).model.embed_tokens.weight
    b = AutoModelForCausalLM.from_pretrained(str(again)).model.embed_tokens.weight
    assert torch.equal(a, b)


def test_deepseek_config_has_the_cpu_mla_keys(tmp_path: Path) -> None:
    from agent.extract.tinymodel import deepseek_v3_config

    cfg = deepseek_v3_config()
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)  # CPU MLA kernel: head size 576
    assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")


def test_dataset_text_token_ids_truncation_and_limit(tiny: Path, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "w1 w2 w3 w4"}\n\n{"token_ids": [9, 8, 7, 6, 5]}\n{"token_ids": [1]}\n')
    samples = load(data, tiny, seq_len=3, max_samples=2)
    assert [(s.idx, s.token_ids) for s in samples] == [(0, (5, 6, 7)), (1, (9, 8, 7))]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", "d.jsonl:1: not JSON"),
        ('{"tokens": [1]}\n', "d.jsonl:1: expected 'token_ids'"),
        ('{"token_ids": []}\n', "d.jsonl:1: sample has no tokens"),
        ("\n", "has no samples"),
    ],
)
def test_dataset_errors_name_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load(data, tmp_path, seq_len=8, max_samples=None)


def test_milestone_line_format(capsys: pytest.CaptureFixture[str]) -> None:
    emit(
        "progress",
        samples_done=3,
        samples_total=10,
        tokens_per_s=12.5,
        files_written=3,
        bytes_written=99,
    )
    line = capsys.readouterr().out
    assert line.endswith("\n") and line.startswith("EAGLEWATCH {")
    assert json.loads(line[len("EAGLEWATCH ") :]) == {
        "kind": "progress",
        "samples_done": 3,
        "samples_total": 10,
        "tokens_per_s": 12.5,
        "files_written": 3,
        "bytes_written": 99,
    }
    with pytest.raises(ValueError, match="unknown milestone kind"):
        format_line("progres")
