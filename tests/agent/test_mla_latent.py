"""A per-token width equal to the model's kv_lora_rank is named as the MLA latent, not the residual stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent.checks.checker import expectation, expectation_from_model, find_kv_lora_rank
from agent.checks.formats import SPECFORGE, check_sample
from agent.checks.shapes import MLA_LATENT_HINT, Expectation, TensorMeta, check_layer_list, check_shapes

REPO = Path(__file__).resolve().parents[2]
DSV3 = Expectation(layers=4, hidden_size=7168, kv_lora_rank=512)


@pytest.mark.parametrize(
    ("width", "expect", "latent"),
    [
        (512, DSV3, True),  # the attention latent captured instead of the residual stream
        (1536, DSV3, False),  # another wrong width: a plain mismatch
        (512, Expectation(layers=4, hidden_size=7168), False),  # not an MLA model: nothing to name
    ],
)
def test_safetensors_width(width: int, expect: Expectation, latent: bool) -> None:
    (p,) = check_shapes("hs_0.safetensors", (9,), (9, 4, width), "BF16", expect, "I64")
    assert p.code == "hidden_size_mismatch"
    assert p.message.startswith(f"hidden size mismatch: hidden_states has {width}, expected 7168")
    assert (MLA_LATENT_HINT in p.message) is latent


def test_layer_list_and_specforge_widths() -> None:
    items = [TensorMeta((9, 512), "BF16")] * 4
    (p,) = check_layer_list("data_0.pt", "hidden_states", items, 9, DSV3)
    assert p.code == "hidden_size_mismatch" and "kv_lora_rank" in p.message and MLA_LATENT_HINT in p.message
    sample = {
        "input_ids": TensorMeta((9,), "I64"),
        "loss_mask": TensorMeta((9,), "I64"),
        "hidden_state": TensorMeta((1, 9, 512), "BF16"),
        "aux_hidden_state": TensorMeta((1, 9, 3 * 512), "BF16"),
    }
    problems = check_sample("data_0.ckpt", SPECFORGE, sample, DSV3)  # type: ignore[arg-type]
    assert [p.code for p in problems] == ["hidden_size_mismatch", "hidden_size_mismatch"]
    assert all(MLA_LATENT_HINT in p.message for p in problems), problems


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"hidden_size": 7168, "kv_lora_rank": 512}, 512),
        ({"text_config": {"hidden_size": 7168, "kv_lora_rank": 512}}, 512),  # Kimi-K2.5-style wrapper
        ({"hidden_size": 4096}, None),
        ({"kv_lora_rank": None}, None),
        ({"kv_lora_rank": True}, None),
    ],
)
def test_find_kv_lora_rank(config: dict[str, object], want: int | None) -> None:
    assert find_kv_lora_rank(config) == want


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "kv_lora_rank": 16}))
    return model


def test_expectations_carry_the_rank(tmp_path: Path) -> None:
    model = _model(tmp_path)
    assert expectation_from_model(model, [2, 4, 5, 8]) == Expectation(4, 64, 16)
    # the daemon's child check: explicit layers and hidden size still take the rank from the model
    assert expectation({"path": "x", "layers": 3, "hidden_size": 64, "model": str(model)}) == Expectation(
        3, 64, 16
    )


def test_check_command_names_the_latent(tmp_path: Path) -> None:
    model = _model(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    save_file(
        {"token_ids": torch.arange(5), "hidden_states": torch.randn(5, 4, 16)},
        str(out_dir / "hs_0.safetensors"),
    )
    p = subprocess.run(
        [sys.executable, "-m", "agent", "check", str(out_dir), "--model", str(model), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    (problem,) = json.loads(p.stdout)["problems"]
    assert problem["code"] == "hidden_size_mismatch"
    assert problem["message"].endswith(f"(16 is the model's kv_lora_rank: {MLA_LATENT_HINT})")
