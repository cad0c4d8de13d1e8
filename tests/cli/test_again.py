"""``runs start --again RUN`` and ``runs resume RUN`` through the real CLI and a local agent."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_commands import cli

pytestmark = pytest.mark.timeout(180)


def _show(tmp_path: Path, run_id: str) -> dict[str, Any]:
    res = cli(tmp_path, "runs", "show", run_id, "--json")
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def _wait_state(tmp_path: Path, run_id: str, states: tuple[str, ...]) -> dict[str, Any]:
    deadline = time.monotonic() + 90
    while (run := _show(tmp_path, run_id))["state"] not in states:
        assert time.monotonic() < deadline, f"run {run_id} still {run['state']}"
        time.sleep(0.5)
    return run


def test_again_and_resume(tmp_path: Path, reap: None) -> None:
    add = cli(tmp_path, "hosts", "add", "loc", "--ssh", "local", "--state-dir", str(tmp_path / "agent"))
    assert add.returncode == 0, add.stderr
    first = cli(
        tmp_path, "runs", "start", "--host", "loc", "--json", "--name", "hello", "--env", "A=1",
        "--", sys.executable, "-c", "print('hi')",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    first_id = json.loads(first.stdout)["id"]

    again = cli(tmp_path, "runs", "start", "--again", first_id, "--name", "hello-2", "--json")
    assert again.returncode == 0, again.stderr
    again_id = json.loads(again.stdout)["id"]
    copy = _show(tmp_path, again_id)
    assert again_id != first_id and copy["host"] == "loc" and copy["name"] == "hello-2"
    assert copy["spec"]["command"] == [sys.executable, "-c", "print('hi')"] and copy["spec"]["env"] == {
        "A": "1"
    }

    _wait_state(tmp_path, first_id, ("completed",))
    refused = cli(tmp_path, "runs", "resume", first_id)
    assert refused.returncode == 1 and "completed" in refused.stderr

    # an extraction whose job refuses its spec (no model has hidden size 1) fails; resuming it keeps its
    # output directory
    out, model, data = tmp_path / "out", tmp_path / "model", tmp_path / "data.jsonl"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 32}))
    data.write_text("{}\n")
    ext = cli(
        tmp_path, "runs", "start", "--host", "loc", "--json", "--backend", "worker-extension",
        "--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--expect-hidden-size", "1",
    )  # fmt: skip
    assert ext.returncode == 0, ext.stderr
    ext_id = json.loads(ext.stdout)["id"]
    _wait_state(tmp_path, ext_id, ("failed",))
    resumed = cli(tmp_path, "runs", "resume", ext_id, "--json")
    new_id = json.loads(resumed.stdout)["id"]
    assert new_id != ext_id and json.loads(resumed.stdout)["resumes"] == ext_id
    detail = _show(tmp_path, new_id)
    assert detail["resumed_from"] == ext_id and detail["spec"]["output_dir"] == str(out)
    assert detail["spec"]["resume"] is True
    assert _show(tmp_path, ext_id)["resumed_by"] == [new_id]
    twice = cli(tmp_path, "runs", "resume", ext_id)
    assert twice.returncode == 1 and f"already resumed as {new_id}" in twice.stderr
