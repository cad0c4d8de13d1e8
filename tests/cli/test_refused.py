"""``runs start`` with a host path the host cannot use: refused before launch, field named, no run left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_commands import cli

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_unusable_paths_are_refused_naming_the_field(tmp_path: Path, reap: None) -> None:
    res = cli(tmp_path, "hosts", "add", "loc", "--ssh", "local", "--state-dir", str(tmp_path / "agent"))
    assert res.returncode == 0, res.stderr
    model, scripts, data = tmp_path / "model", tmp_path / "scripts", tmp_path / "data.jsonl"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 32}))
    scripts.mkdir()
    (scripts / "prepare_hidden_states.py").touch()
    data.write_text("{}\n")
    spec = tmp_path / "spec.json"
    good = [
        "--host",
        "loc",
        "--model",
        str(model),
        "--dataset",
        str(data),
        "--output-dir",
        str(tmp_path / "o"),
    ]
    cases = [
        (["--model", str(tmp_path / "none")], {}, "model", "does not exist on this host"),
        (["--dataset", str(tmp_path / "none.jsonl")], {}, "dataset", "does not exist on this host"),
        ([], {"backend": "specforge", "specforge": {"scripts_dir": str(model)}}, "specforge.scripts_dir",
         "has no prepare_hidden_states.py"),
    ]  # fmt: skip
    for args, from_file, field, words in cases:
        spec.write_text(json.dumps(from_file))
        res = cli(tmp_path, "runs", "start", *good, "--spec", str(spec), *args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert f"error: {field}: " in res.stderr and words in res.stderr, (args, res.stderr)
        assert res.stdout == ""
    runs = cli(tmp_path, "runs", "ls", "--json", "--no-refresh")
    assert runs.returncode == 0 and json.loads(runs.stdout) == []
    assert not list((tmp_path / "agent" / "runs").iterdir())


def test_a_misspelled_field_names_the_nearest_known_one(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"modle": "/m", "dataset": "/d.jsonl", "output_dir": "/o"}))
    res = cli(tmp_path, "runs", "start", "--host", "h1", "--spec", str(spec))
    assert res.returncode == 2 and "error: modle: not a spec field: did you mean model?" in res.stderr
