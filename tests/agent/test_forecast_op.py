"""The daemon's `forecast` op over its Unix socket: the job's forecast in a child, errors as error replies."""

from __future__ import annotations

import json
from pathlib import Path

from agent.extract.forecast import file_bytes
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon

__all__ = ["agent_daemon"]


def _spec(tmp_path: Path, **over: object) -> dict[str, object]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 8, "hidden_size": 32, "torch_dtype": "bfloat16"})
    )
    data = tmp_path / "data.jsonl"
    data.write_text('{"token_ids": [1, 2, 3]}\n{"token_ids": [4, 5]}\n')
    spec: dict[str, object] = {"host": "local", "model": str(model), "dataset": str(data),
                               "output_dir": str(tmp_path / "out")}  # fmt: skip
    return {**spec, **over}


def test_forecast_op(agent_daemon: AgentProc, tmp_path: Path) -> None:
    with AgentClient(agent_daemon.socket) as c:
        got = c.result("forecast", spec=_spec(tmp_path))
        assert got["bytes"] == file_bytes(3, 4, 32, 2) + file_bytes(2, 4, 32, 2)
        assert got["fits"] is True and got["estimated"] is False and got["free_bytes"] > 0
        bad = c.request("forecast", spec=_spec(tmp_path, model=str(tmp_path / "nope")))
        assert bad["type"] == "error" and bad["code"] == "failed" and "does not exist" in bad["message"]
        cmd = c.request("forecast", spec={"host": "local", "backend": "command", "command": ["true"]})
        assert cmd["code"] == "bad_args" and "no forecast" in cmd["message"]
        assert c.request("forecast")["code"] == "bad_args"
    assert not list(agent_daemon.state_dir.glob("forecast-*"))  # the spec file is gone
