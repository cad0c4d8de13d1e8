"""`eaglewatch-agent check` through a real subprocess: exit codes 0/1/2, --json shape, torch/numpy absent."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
T, L, H = 8, 4, 32

# Run the command with some modules made unimportable: sys.modules[name] = None makes `import name` raise
# ImportError, exactly what a GPU host without torch/numpy gives.
RUNNER = (
    "import sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    if name: sys.modules[name] = None\n"
    "from agent.checks.cli import run\n"
    "sys.exit(run(sys.argv[2:]))\n"
)


def check(*args: str | Path | int, block: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", RUNNER, block, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def hs_file(path: Path, layers: int = L, hs: torch.Tensor | None = None) -> Path:
    hs = torch.randn(T, layers, H).bfloat16() if hs is None else hs
    save_file({"token_ids": torch.arange(T), "hidden_states": hs}, str(path))
    return path


def pt_file(path: Path) -> Path:
    buf = io.BytesIO()
    torch.save(
        {
            "input_ids": torch.arange(T),
            "hidden_states": [torch.randn(T, H) for _ in range(L)],
            "loss_mask": torch.ones(T),
        },
        buf,
    )
    path.write_bytes(buf.getvalue())
    return path


def test_module_entry_point_runs(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "agent.checks.cli", str(tmp_path), "--hidden-size", str(H)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "OK"


def test_exit_0_when_all_good(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors")
    hs_file(tmp_path / "hs_1.safetensors")
    pt_file(tmp_path / "data_0.pt")
    out = check(tmp_path, "--layers", "2,30,58,61", "--hidden-size", H)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 files checked (mixed)" in out.stdout and out.stdout.strip().endswith("OK")


def test_exit_1_and_json_shape_when_problems(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors", layers=3)
    hs_file(tmp_path / "hs_2.safetensors")
    out = check(tmp_path, "--layers", "2,30,58,61", "--hidden-size", H, "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == {"ok", "files", "format", "problems", "unchecked", "notes", "shapes"}
    assert report["ok"] is False and report["files"] == 2 and report["format"] == "safetensors"
    assert [(p["code"], Path(p["file"]).name) for p in report["problems"]] == [
        ("layer_count_mismatch", "hs_0.safetensors"),
        ("index_gap", tmp_path.name),
    ]
    assert all(set(p) == {"code", "file", "message"} for p in report["problems"])
    assert report["problems"][0]["message"].endswith("expected 4 (final layer dropped?)")


def test_human_output_lists_problems(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors", hs=torch.zeros(T, L, H).bfloat16())
    out = check(tmp_path / "hs_0.safetensors")
    assert out.returncode == 1
    assert "all_zero" in out.stdout and "hidden_states is all zero (all 4 layers)" in out.stdout
    assert out.stdout.strip().endswith("FAILED: 1 problem")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["{tmp}/absent"], "no such file or directory"),
        (["{tmp}", "--layers", "2,x"], "'x' is not a non-negative integer"),
        (["{tmp}", "--layers", ""], "expected comma-separated layer ids"),
        (["{tmp}", "--layers", "2,2"], "repeated"),
        (["{tmp}", "--hidden-size", "0"], "must be a positive integer"),
        (["{tmp}", "--hidden-size", "big"], "invalid int value"),
        (["{tmp}", "--frobnicate"], "unrecognized arguments"),
        ([], "the following arguments are required: PATH"),
    ],
)
def test_exit_2_cannot_run(tmp_path: Path, args: list[str], words: str) -> None:
    out = check(*[a.format(tmp=tmp_path) for a in args])
    assert out.returncode == 2, out.stdout + out.stderr
    assert words in out.stderr and out.stdout == ""


def test_exit_2_when_nothing_was_checked(tmp_path: Path) -> None:
    (tmp_path / "hs_0.safetensors").write_bytes(b"\x00")
    (tmp_path / "hs_0.safetensors.lock").touch()
    out = check(tmp_path, "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout)["ok"] is False
    assert "nothing was checked" in out.stderr and "still being written" in out.stderr


def test_help_exits_0() -> None:
    out = check("--help")
    assert out.returncode == 0 and "--layers" in out.stdout


def test_model_option_reads_config(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"hidden_size": H * 2}}))
    data = tmp_path / "out"
    data.mkdir()
    hs_file(data / "hs_0.safetensors")
    out = check(data, "--model", model, "--json")
    assert out.returncode == 1
    (p,) = json.loads(out.stdout)["problems"]
    assert p["code"] == "hidden_size_mismatch" and p["message"].endswith(f"has {H}, expected {H * 2}")


def test_without_torch_pt_is_unchecked_and_safetensors_still_checked(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors", layers=3)
    pt_file(tmp_path / "data_0.pt")
    out = check(tmp_path, "--layers", "2,30,58,61", "--json", block="torch")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["files"] == 1 and report["unchecked"] == [str(tmp_path / "data_0.pt")]
    assert [p["code"] for p in report["problems"]] == ["layer_count_mismatch"]
    assert "1 file unchecked: torch is not importable (needed for .pt/.ckpt files)" in report["notes"]

    (tmp_path / "hs_0.safetensors").unlink()
    hs_file(tmp_path / "hs_0.safetensors")
    human = check(tmp_path, "--layers", "2,30,58,61", block="torch")
    assert human.returncode == 0, human.stdout
    assert "unchecked (1):" in human.stdout and "data_0.pt" in human.stdout
    assert human.stdout.strip().endswith("OK (some files unchecked, see above)")

    (tmp_path / "hs_0.safetensors").unlink()
    only_pt = check(tmp_path, "--json", block="torch")
    assert only_pt.returncode == 2 and json.loads(only_pt.stdout)["ok"] is False


def test_without_numpy_values_are_not_scanned_and_a_note_says_so(tmp_path: Path) -> None:
    hs = torch.randn(T, L, H)
    hs[6, 1, 2] = float("inf")
    hs_file(tmp_path / "hs_0.safetensors", hs=hs.half())
    assert check(tmp_path, "--json").returncode == 1
    out = check(tmp_path, "--json", block="numpy")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["problems"] == []
    assert "value checks (NaN/Inf, all-zero) skipped: numpy is not importable" in report["notes"]


def test_stdlib_only_header_check_without_numpy_torch_safetensors(tmp_path: Path) -> None:
    hs_file(tmp_path / "hs_0.safetensors", hs=torch.zeros(T, L, H).bfloat16())
    hs_file(tmp_path / "hs_1.safetensors", layers=2)
    out = check(tmp_path, "--layers", "1,2,3,4", "--json", block="numpy,torch,safetensors")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert [p["code"] for p in report["problems"]] == ["layer_count_mismatch"]  # all-zero needs a value scan
    assert any("value checks (NaN/Inf, all-zero) skipped" in n for n in report["notes"])


def test_control_characters_in_names_are_escaped(tmp_path: Path) -> None:
    (tmp_path / "evil\x1b[2J.safetensors").write_bytes(b"\x00")
    out = check(tmp_path)
    assert out.returncode == 1
    assert "\x1b" not in out.stdout and "evil\\x1b[2J.safetensors" in out.stdout


def test_through_the_agent_command_line(tmp_path: Path) -> None:
    """The path the daemon and users take: `python -m agent check` (agent/cli.py dispatches to cmd_check)."""
    hs_file(tmp_path / "hs_0.safetensors", layers=3)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "agent", "check", str(tmp_path), "--layers", "2,30,58,61", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert [p["code"] for p in json.loads(out.stdout)["problems"]] == ["layer_count_mismatch"]


def test_many_problems_are_summarised_in_human_output(tmp_path: Path) -> None:
    for i in range(60):
        (tmp_path / f"hs_{i}.safetensors").write_bytes(b"\x00")
    out = check(tmp_path)
    assert out.returncode == 1
    assert "… and 10 more (--json lists all)" in out.stdout
    assert "problems by code: unreadable × 60" in out.stdout
    assert len(json.loads(check(tmp_path, "--json").stdout)["problems"]) == 60
