"""The daemon's `forecast` and `manifest` ops over its Unix socket (real daemon, real child processes)."""

from __future__ import annotations

import json
from pathlib import Path

from agent.extract.pipelines.forecast import specforge_file_bytes
from agent.extract.planning.forecast import file_bytes
from tests.helpers.agentjobs import printer
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
        assert bad["code"] == "bad_args" and bad["message"].startswith("spec.model: "), bad
        assert "does not exist" in bad["message"]
        cmd = c.request("forecast", spec={"host": "local", "backend": "command", "command": ["true"]})
        assert cmd["code"] == "bad_args" and "no forecast" in cmd["message"]
        assert c.request("forecast")["code"] == "bad_args"
        scripts = tmp_path / "SpecForge" / "scripts"
        scripts.mkdir(parents=True)
        (scripts / "prepare_hidden_states.py").touch()
        sf = _spec(tmp_path, backend="specforge", specforge={"scripts_dir": str(scripts)})
        got = c.result("forecast", spec={**sf, "seq_len": 100})
        # no tokenizer in the model folder: each row counts at most --max-length (seq_len) tokens
        assert got["estimated"] is True and got["samples"] == 2 and got["tokens"] == 100 + 100
        assert got["bytes"] == 2 * specforge_file_bytes(100, 32, 2)
    assert not list(agent_daemon.state_dir.glob("forecast-*"))  # the spec file is gone


def test_manifest_op_returns_the_card_without_the_sample_map(agent_daemon: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = {
        "host": "local",
        "backend": "command",
        "command": printer(tmp_path, ["x"]),
        "output_dir": str(out),
    }
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="m-1", spec=spec)
        missing = c.request("manifest", run="m-1")
        assert missing["code"] == "not_found" and "no manifest.json" in missing["message"]
        out.mkdir(exist_ok=True)
        card = {
            "model": "/m",
            "layer_stats": {"2": {"rms": 1.0}},
            "samples": {"0": 5, "1": 7},
            "tokens_total": 12,
        }
        (out / "manifest.json").write_text(json.dumps(card))
        got = c.result("manifest", run="m-1")
        assert got == {
            "model": "/m",
            "layer_stats": {"2": {"rms": 1.0}},
            "tokens_total": 12,
            "samples_listed": 2,
        }
        assert c.request("manifest", run="nope")["code"] == "not_found"
