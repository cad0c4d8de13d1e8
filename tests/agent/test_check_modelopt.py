"""The checker reads NVIDIA Model-Optimizer's offline layout: real files written with torch.save as its
examples/speculative_decoding/collect_hidden_states/compute_hidden_states_{hf,vllm,trtllm}.py write them.

One ``{conversation_id}.pt`` per conversation holding ``input_ids`` [T] (int64), ``hidden_states`` [T, H]
(the last layer), ``aux_hidden_states`` [T, k·H] (k auxiliary layers concatenated; three by default),
``loss_mask`` [T] (int64) and ``conversation_id``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.checks.checker import Expectation, check_path
from agent.checks.formats import MODELOPT

T, H = 12, 16


def sample(t: int = T, aux_layers: int = 3, **over: Any) -> dict[str, Any]:
    """A Model-Optimizer sample of t tokens in bf16 (the model's dtype), some of it replaced by ``over``."""
    out: dict[str, Any] = {
        "input_ids": torch.randint(0, 1000, (t,)),
        "hidden_states": torch.randn(t, H).to(torch.bfloat16),
        "aux_hidden_states": torch.randn(t, aux_layers * H).to(torch.bfloat16),
        "loss_mask": torch.ones(t, dtype=torch.long),
        "conversation_id": "conv-7",
    }
    return {**out, **over}


def write(folder: Path, name: str, obj: dict[str, Any]) -> Path:
    """torch.save obj as folder/name, as the dump scripts do."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(obj, folder / name)
    return folder / name


def test_good_files_pass_and_are_named_modelopt(tmp_path: Path) -> None:
    write(tmp_path, "conv-1.pt", sample())
    write(tmp_path, "d41d8cd9-8f00-b204.pt", sample(t=5, loss_mask=torch.zeros(5, dtype=torch.long)))
    write(tmp_path, "17.pt", {k: v for k, v in sample().items() if k != "loss_mask"})  # loss_mask is optional
    report = check_path(tmp_path, Expectation(layers=4, hidden_size=H))
    assert report.ok and report.files == 3 and report.format == MODELOPT, report.problems


@pytest.mark.parametrize(
    ("obj", "code", "words"),
    [
        (
            sample(aux_layers=2),
            "layer_count_mismatch",
            f"aux_hidden_states has 2 layers ({2 * H} = 2 × {H}), expected 3 (+ hidden_states as layer 4)",
        ),
        (
            sample(hidden_states=torch.randn(T - 1, H)),
            "seq_len_mismatch",
            f"hidden_states has {T - 1} tokens but input_ids has {T}",
        ),
        (
            sample(aux_hidden_states=torch.randn(T - 2, 3 * H)),
            "seq_len_mismatch",
            f"aux_hidden_states has {T - 2} tokens but input_ids has {T}",
        ),
        (
            sample(hidden_states=torch.full((T, H), float("nan"))),
            "non_finite",
            f"hidden_states has {T * H} NaN/Inf values (first at token 0)",
        ),
        (
            sample(aux_hidden_states=torch.randn(T, 3 * H).index_fill_(0, torch.tensor([4]), float("nan"))),
            "non_finite",
            f"aux_hidden_states has {3 * H} NaN/Inf values (first at token 4, layer 0)",
        ),
        (
            sample(aux_hidden_states=torch.empty(0)),
            "layer_count_mismatch",
            "aux_hidden_states is empty ([0]): no auxiliary layer captured, expected 3",
        ),
        (
            sample(hidden_states=torch.randn(T, 24)),
            "hidden_size_mismatch",
            "hidden_states has 24, expected 16",
        ),
        (
            {k: v for k, v in sample().items() if k != "aux_hidden_states"},
            "missing_key",
            "missing key 'aux_hidden_states'",
        ),
    ],
    ids=[
        "dropped-aux-layer",
        "rows-short",
        "aux-rows-short",
        "nan",
        "nan-aux",
        "no-aux",
        "width",
        "no-aux-key",
    ],
)
def test_problems_are_named(tmp_path: Path, obj: dict[str, Any], code: str, words: str) -> None:
    path = write(tmp_path, "conv-3.pt", obj)
    report = check_path(path, Expectation(hidden_size=H))
    assert [p.code for p in report.problems] == [code], report.problems
    assert words in report.problems[0].message and report.format == MODELOPT


def test_the_check_command_reads_a_modelopt_dump_with_its_model(tmp_path: Path) -> None:
    """`eaglewatch-agent check DIR --model M`: the hidden size comes from config.json, 4 layers by default."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": H, "num_hidden_layers": 8}))
    out = tmp_path / "dump"
    write(out, "conv-0.pt", sample())
    write(out, "conv-1.pt", sample(aux_layers=2))
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "check", str(out), "--model", str(model), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["files"] == 2 and report["format"] == MODELOPT, proc.stderr
    (problem,) = report["problems"]
    assert problem["code"] == "layer_count_mismatch" and problem["file"] == str(out / "conv-1.pt")
