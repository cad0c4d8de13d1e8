"""Errors before any engine starts: the job exits 2 with one clear message (real subprocess, real files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.extract.jobrun import ROOT, job_env, parse_events


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with just the config.json the preflight reads (N = 8 layers, hidden 128)."""
    d = tmp_path_factory.mktemp("m")
    cfg = {"num_hidden_layers": 8, "hidden_size": 128, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _run(
    tmp_path: Path, spec: dict[str, object] | str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    path = tmp_path / "spec.json"
    path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
    p = subprocess.run(
        [sys.executable, "-m", "agent", "extract", "--spec", str(path)],
        cwd=ROOT,
        env=job_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stdout, p.stderr


def _spec(model: Path, tmp_path: Path, **over: object) -> dict[str, object]:
    data = tmp_path / "data.jsonl"
    data.write_text('{"token_ids": [1, 2, 3]}\n')
    base: dict[str, object] = {
        "host": "local",
        "model": str(model),
        "dataset": str(data),
        "output_dir": str(tmp_path / "out"),
    }
    base.update(over)
    return base


def _one_error(rc: int, out: str, err: str) -> str:
    assert rc == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    (failed,) = parse_events(out)
    assert failed["kind"] == "failed" and failed["reason"] in lines[0]
    assert "Initializing a V1 LLM engine" not in out + err  # no engine was started
    return lines[0]


def test_bad_layer_id(model: Path, tmp_path: Path) -> None:
    msg = _one_error(*_run(tmp_path, _spec(model, tmp_path, layers=[2, 4, 9])))
    assert "layer id(s) [9] out of range" in msg and "8 layers" in msg and "0..8" in msg


def test_output_convention_allows_only_up_to_n_minus_1(model: Path, tmp_path: Path) -> None:
    msg = _one_error(*_run(tmp_path, _spec(model, tmp_path, layers=[1, 8], layer_convention="output")))
    assert "[8] out of range" in msg and "0..7" in msg


def test_missing_model_path(tmp_path: Path) -> None:
    msg = _one_error(*_run(tmp_path, _spec(tmp_path / "nope", tmp_path)))
    assert f"model path {tmp_path / 'nope'} does not exist" in msg


def test_model_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    msg = _one_error(*_run(tmp_path, _spec(tmp_path / "empty", tmp_path)))
    assert "has no config.json" in msg


def test_missing_dataset(model: Path, tmp_path: Path) -> None:
    msg = _one_error(*_run(tmp_path, _spec(model, tmp_path, dataset=str(tmp_path / "none.jsonl"))))
    assert f"dataset {tmp_path / 'none.jsonl'} does not exist" in msg


def test_bad_dataset_line(model: Path, tmp_path: Path) -> None:
    spec = _spec(model, tmp_path)
    Path(str(spec["dataset"])).write_text('{"token_ids": [1, 2]}\n{"token_ids": "x"}\n')
    msg = _one_error(*_run(tmp_path, spec))
    assert "data.jsonl:2: 'token_ids' must be a list of non-negative integers" in msg


def test_invalid_spec_names_the_field(model: Path, tmp_path: Path) -> None:
    msg = _one_error(*_run(tmp_path, _spec(model, tmp_path, batch_size=0)))
    assert "batch_size" in msg
    msg = _one_error(*_run(tmp_path, "{not json"))
    assert "is not valid JSON" in msg


def test_unsupported_backend_for_installed_vllm(model: Path, tmp_path: Path) -> None:
    """A stand-in vLLM 0.9.2 (a package dir + dist-info first on the path) lacks the native connector."""
    fake = tmp_path / "site"
    (fake / "vllm" / "v1" / "worker").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("")
    (fake / "vllm" / "v1" / "worker" / "worker_base.py").write_text("worker_extension_cls = None\n")
    dist = fake / "vllm-0.9.2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.9.2\n")
    env = {"PYTHONPATH": f"{fake}:{ROOT}"}
    msg = _one_error(*_run(tmp_path, _spec(model, tmp_path, backend="vllm-native"), env))
    assert "backend 'vllm-native' is not supported here: vLLM 0.9.2 has no ExampleHiddenStates" in msg
    msg = _one_error(*_run(tmp_path, _spec(model, tmp_path, backend="worker-extension"), env))
    assert "vLLM 0.9.2 has no per-step num_scheduled_tokens" in msg
